/* AMX's tile unit (Sapphire Rapids and later), shared by gemm_bf16.c and gemm_quant.c: the tile configuration
 * and Linux's permission to use the tile state. A source that includes this defines _DEFAULT_SOURCE before any
 * header (syscall() under -std=c11). */
#ifndef COBATCH_AMX_H
#define COBATCH_AMX_H

#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ldtilecfg's 64-byte operand (palette 1): each tile register's rows and bytes per row. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux grants the tile state only on request (once per process; each source asks for itself, which is
 * idempotent): whether it did. */
static inline int amx_permitted(void) {
    static int state = -1; /* -1: not asked yet */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

#endif

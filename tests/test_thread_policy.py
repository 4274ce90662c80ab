"""The adaptive thread policy: its decisions and hysteresis on fed samples, /proc/stat parsing, and a real
engine dropping to one thread beside busy processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cobatch.runner import thread_policy
from cobatch.runner.cpu_usage import _TICK_S, CpuSample, others_busy_cores, read_cpu_sample
from cobatch.runner.thread_policy import ThreadGovernor, ThreadPolicy


class Clock:
    """Feeds a policy windows of given others' busy cores (this process idle), 0.2 s each."""

    def __init__(self, policy: ThreadPolicy) -> None:
        self.policy, self.t, self.busy = policy, 0.0, 0.0
        policy.observe(self.sample())

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, 0.0)

    def window(self, others_cores: float, seconds: float = 0.2) -> int:
        self.t += seconds
        self.busy += others_cores * seconds
        return self.policy.observe(self.sample())


def test_others_busy_cores_excludes_this_process():
    start, end = CpuSample(10.0, 100.0, 5.0), CpuSample(10.5, 100.8, 5.3)
    assert others_busy_cores(start, end) == pytest.approx(1.0)  # 0.8 busy - 0.3 own over 0.5 s
    assert others_busy_cores(end, end) == 0.0
    assert others_busy_cores(start, CpuSample(10.5, 100.1, 5.3)) == 0.0  # tick rounding: never negative


def test_read_cpu_sample_counts_only_the_given_cpus_busy_columns(tmp_path: Path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is already in user)
    stat.write_text("cpu  999 0 0 0 0 0 0 0 0 0\n"
                    "cpu0 100 10 20 5000 40 1 2 7 50 0\n"
                    "cpu1 300 0 0 100 0 0 0 0 0 0\n"
                    "intr 12 0\n")
    assert read_cpu_sample({0}, str(stat)).busy_s == pytest.approx(140 * _TICK_S)
    assert read_cpu_sample({0, 1}, str(stat)).busy_s == pytest.approx(440 * _TICK_S)
    assert read_cpu_sample({0}, str(tmp_path / "missing")) is None


def test_starts_with_every_thread_and_keeps_them_on_a_free_machine():
    policy = ThreadPolicy(max_threads=2, num_cpus=2)
    clock = Clock(policy)
    assert policy.num_threads == 2
    assert [clock.window(0.1) for _ in range(20)] == [2] * 20


def test_drops_at_the_first_contended_window():
    clock = Clock(ThreadPolicy(max_threads=2, num_cpus=2))
    assert clock.window(0.1) == 2
    assert clock.window(0.7) == 1  # one busy neighbour, squeezed by our two threads: 0.7 of a core


def test_comes_back_only_after_up_after_s_of_free_windows():
    policy = ThreadPolicy(max_threads=2, num_cpus=2, up_after_s=1.0)
    clock = Clock(policy)
    clock.window(1.0)
    assert [clock.window(0.05) for _ in range(4)] == [1] * 4  # 0.8 s free: not yet
    assert clock.window(0.05) == 2  # 1.0 s free


def test_band_between_the_thresholds_holds_either_count():
    """Others at 0.4 of a core: enough to keep one thread down, too little to drop a second one."""
    down = ThreadPolicy(max_threads=2, num_cpus=2)
    clock = Clock(down)
    clock.window(1.0)
    assert [clock.window(0.4) for _ in range(20)] == [1] * 20
    up = Clock(ThreadPolicy(max_threads=2, num_cpus=2))
    assert [up.window(0.4) for _ in range(20)] == [2] * 20


def test_an_intermittent_neighbour_does_not_make_it_flap():
    """Contended every 0.6 s: each contended window resets the wait for a free second, so it stays down."""
    policy = ThreadPolicy(max_threads=2, num_cpus=2, up_after_s=1.0)
    clock = Clock(policy)
    counts = []
    for _ in range(10):
        counts.append(clock.window(1.0))
        counts += [clock.window(0.0), clock.window(0.0)]
    assert set(counts) == {1}


def test_samples_inside_a_window_decide_nothing():
    policy = ThreadPolicy(max_threads=2, num_cpus=2, window_s=0.2)
    clock = Clock(policy)
    assert clock.window(2.0, seconds=0.1) == 2  # 0.1 s: the window is still open
    assert not policy.is_due(clock.t)
    assert clock.window(2.0, seconds=0.1) == 1  # closes at 0.2 s, measured from its first sample
    assert policy.others_cores == pytest.approx(2.0)


def test_many_cpus_keep_the_cores_others_leave_free():
    policy = ThreadPolicy(max_threads=16, num_cpus=16)
    clock = Clock(policy)
    assert clock.window(3.0) == 13
    assert clock.window(15.9) == 1  # never below one
    big = Clock(ThreadPolicy(max_threads=4, num_cpus=16))
    assert big.window(3.0) == 4  # never above --num-threads


def test_governor_applies_on_its_first_step_and_on_changes_only(monkeypatch):
    samples = iter([CpuSample(0.0, 0.0, 0.0), CpuSample(0.2, 0.3, 0.0), CpuSample(0.4, 0.6, 0.2)])
    monkeypatch.setattr(thread_policy, "read_cpu_sample", lambda cpus: next(samples))
    monkeypatch.setattr(thread_policy.time, "monotonic", lambda: 100.0)
    applied: list[int] = []
    governor = ThreadGovernor(ThreadPolicy(2, 2), {0, 1}, applied.append)
    assert governor.before_step() == 2  # opens the first window
    assert governor.before_step() == 1  # others 1.5 cores over 0.2 s
    assert governor.before_step() == 1
    assert applied == [2, 1]


@pytest.fixture
def busy_neighbours():
    """Two spin loops (pinned nowhere) for the test."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def test_engine_drops_to_one_thread_beside_busy_processes(tiny_model_dir: Path, busy_neighbours):
    """Two spin loops keep at least one of 2 CPUs from us: within a few windows the steps run one thread."""
    import torch

    from cobatch import LLM, SamplingParams

    if len(thread_policy.usable_cpus()) != 2:
        pytest.skip("the two-neighbour bound is for a 2-CPU machine")
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=2)
    governor = llm.engine.runner.thread_governor
    assert governor is not None and governor.policy.max_threads == 2
    deadline = time.monotonic() + 20.0
    while governor.num_threads != 1 and time.monotonic() < deadline:
        llm.generate(["hello"] * 4, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert governor.num_threads == 1, f"others kept {governor.policy.others_cores:.2f} CPUs busy"
    assert torch.get_num_threads() == 1  # offline, the steps run on this thread


def test_fixed_policy_has_no_governor(tiny_model_dir: Path):
    from cobatch import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
              thread_policy="fixed")
    assert llm.engine.runner.thread_governor is None


class Alternating:
    """A governor stand-in that switches between 1 and 2 threads at every step."""

    def __init__(self) -> None:
        self.steps = 0

    def before_step(self) -> int:
        import torch

        self.steps += 1
        torch.set_num_threads(1 + self.steps % 2)
        return 1 + self.steps % 2


def test_switching_threads_between_steps_changes_no_token(tiny_model_dir: Path):
    """The policy may change the count at any step: greedy outputs stay those of a fixed count."""
    from cobatch import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
              thread_policy="fixed", num_threads=2)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.runner.thread_governor = switching = Alternating()
    switched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert switching.steps > 20 and switched == fixed

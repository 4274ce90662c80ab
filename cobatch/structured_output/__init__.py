"""Structured outputs: JSON schema / regex / choice / grammar constraints on decoding (llguidance).

grammar_spec: params -> grammar text, checked (ValueError); backend: the tokenizer info and compiles;
compiler: a thread pool and a cache of compiled grammars; request_grammar: one sequence's matcher;
bitmask: one step's token masks, applied in one batched op; manager: what the engine calls.
"""

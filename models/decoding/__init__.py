"""The decoding runtime: the one speculative decoder (`decoder`), its acceptance rules
(`verify`), the drafter protocol (`drafter`) and the KV cache the decoder owns (`cache`). It sits
below both `mtpkit.eval` (benchmarks, the generate CLI) and `mtpkit.train` (training's simulated
tau), so both run heads through the same loop."""

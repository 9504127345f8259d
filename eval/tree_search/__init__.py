"""Draft-tree search before serving (`eval/tree_frontier.py` is its command), after "EntMTP:
Accelerating LLM Inference with Entropy Guided Multi Token Prediction" (Chen): greedy tree growth,
one-step scoring, re-scoring on the tree's own rollout, a throughput frontier, static / ladder /
hysteresis schedules. One module per step:

- `calibration`: the teacher-forced pass per prompt (gated LoRA, the probe, MTPC) and its file;
- `simulate`: decoding replayed on a calibration (the acceptance simulator);
- `growth`: trees grown one node at a time;
- `pricing`: each tree's step cost on this machine, and tokens per second;
- `schedules`: the frontier, the bank, the calibrated schedules and the future-known bound;
- `subjects`: the drafter whose trees are searched;
- `check`: the bank's trees decoded on held-out prompts against the simulator;
- `report`: the bank's table and plot.
"""

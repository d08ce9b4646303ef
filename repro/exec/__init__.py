"""Real multi-process expert-parallel MoE execution over torch.distributed (gloo on CPU, NCCL on GPU).

- `repro.exec.launch`: start a process group and run one worker per rank (`launch` spawns them here, `join`
  makes this process one rank of a torchrun / SLURM job).
- `repro.exec.moe`: one EP MoE layer whose all-to-alls carry real bytes (`ep_moe_forward`), the Attention-TP
  shuffled reduce-scatter / all-gather (Sem-MoE Algorithm 3), and `CommRecord`, the bytes each rank sent.
- `repro.exec.trace_mode`: a fitted plan executed on a routing trace's tokens, its bytes checked against the
  evaluator's and its outputs against the single-process MoE (`python -m repro.run experiment=exec`; under
  torchrun each process is one rank).
- `repro.exec.model`: the suite's trained tiny Mixtral end to end on real ranks, Attention-DP or -TP, its logits
  checked against the single-process transformers model (`experiment=exec_model`).
"""

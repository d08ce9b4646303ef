"""Routing captured inside vLLM's CPU engine, one request at a time; run with the engine venv's python by
bench.engine_cpu (it imports vllm, never repro):

    .venv-engine-cpu/bin/python bench/engine_cpu_capture.py JOB.json OUT.jsonl

JOB.json: {"checkpoint", "prompts": [[ids]], "max_tokens": [n], "allowed_token_ids": [ids]}. The engine runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni", eager, no compilation), so forward hooks on every
layer's router (`block_sparse_moe.gate`, whose first output is the router logits [tokens, experts]) see each
forward's rows. Requests go one at a time, so a request's rows are its prefill forward's then one per decode step:
its prompt, then every generated token but the last, as the suite's traces hold them. A token's experts are the
top-k of the logits (softmax keeps the order). Greedy over `allowed_token_ids` (the tiny model's own vocabulary:
the suite never generates its UNK id). Each OUT line is what `python -m repro.engines.capture responses --engine
vllm` reads: {"input_ids": prompt, "response": {"choices": [{"routed_experts": base64 .npy int16[rows, layers, k],
"token_ids": generated}]}}.
"""

from __future__ import annotations

import base64
import io
import json
import sys


def main(job_path: str, out_path: str) -> int:
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    job = json.loads(open(job_path).read())
    config = json.loads(open(f"{job['checkpoint']}/config.json").read())
    top_k, num_layers = config["num_experts_per_tok"], config["num_hidden_layers"]
    llm = LLM(model=job["checkpoint"], dtype="float32", max_model_len=2048, enforce_eager=True,
              compilation_config={"mode": 0}, distributed_executor_backend="uni", enable_prefix_caching=False,
              seed=0)
    logits: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def install(model):
        gates = [(name, module) for name, module in model.named_modules() if name.endswith("block_sparse_moe.gate")]
        for name, module in gates:
            layer = int(name.split("layers.")[1].split(".")[0])
            module.register_forward_hook(lambda _m, _i, out, layer=layer: logits[layer].append(
                (out[0] if isinstance(out, tuple) else out).detach().float().cpu()))
        return len(gates)

    hooked = llm.apply_model(install)
    if hooked != [num_layers]:
        raise SystemExit(f"found {hooked} router modules, expected [{num_layers}]: this vLLM names them otherwise.")
    lines = []
    for prompt, max_tokens in zip(job["prompts"], job["max_tokens"], strict=True):
        for per_layer in logits:
            per_layer.clear()
        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True,
                                allowed_token_ids=job["allowed_token_ids"])
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        generated = list(output.token_ids)
        rows = len(prompt) + len(generated) - 1
        stacked = [torch.cat(per_layer) for per_layer in logits]
        if any(len(s) != rows for s in stacked):
            raise SystemExit(f"the hooks saw {[len(s) for s in stacked]} rows per layer for a request of {rows}: the "
                             "engine batched or padded across requests.")
        experts = torch.stack([s.topk(top_k, dim=-1).indices for s in stacked], dim=1).numpy().astype(np.int16)
        buffer = io.BytesIO()
        np.save(buffer, experts, allow_pickle=False)
        lines.append(json.dumps({"input_ids": prompt, "response": {"choices": [
            {"routed_experts": base64.b64encode(buffer.getvalue()).decode(), "token_ids": generated}]}}))
    with open(out_path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    import os

    os.replace(out_path + ".tmp", out_path)
    print(f"captured {len(lines)} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

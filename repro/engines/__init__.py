"""Adapters between this suite and real serving engines (SGLang, vLLM).

    layout.py         the served model's layers (HF config.json, a sim shape, a job's config) + saved plans
    sglang.py         plan -> `--init-expert-location` JSON, SGLang's rules, launch command, "ignored location" check
    payloads.py       decoders of engine routing payloads (SGLang base64 int32, vLLM base64 .npy, recorder dumps)
    capture.py        send a workload to a running server, import its routed experts as a RoutingTrace
    router.py         semantic DP-rank router: an async HTTP proxy scoring ranks with the plan's tables
    vllm.py           plan -> MoE-layer placement JSON and the `vllm.general_plugins` EPLB-policy plugin
    bench_serving.py  request-rate sweep against a served plan (TTFT / TPOT / E2E in the simulator's schema)

Nothing here imports sglang or vllm at module level: the engines are CUDA wheels of several GB, and the
suite's tests run without them (the vLLM plugin imports vllm only inside the function vLLM calls).
"""

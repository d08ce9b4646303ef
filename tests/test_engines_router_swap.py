"""The semantic router swaps to a new plan while requests are in flight (issue 34, item 6): a request already
dispatched keeps its rank and gets its answer, new requests use the new plan, a decision is never half one plan
and half the other, and a reload that cannot be routed keeps the plan in place. Fake upstreams on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import Counter

import aiohttp
import numpy as np
import pytest
from test_engines_capture import serve_in_thread
from test_engines_router import DEVICES, VOCAB, fake_upstream, rank_header, semmoe_plan
from test_engines_sglang import write_job

from repro.engines.router import SemanticRouter, build_app, reload_plan
from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Plan


class OneRank(Plan):
    """Sends every request to `rank`; `gate`, when set, holds each decision until it is released."""

    def __init__(self, rank: int, devices: int = DEVICES, gate: threading.Event | None = None):
        from test_engines_sglang import toy_placement

        self.rank, self.gate, self.entered = rank, gate, threading.Event()
        super().__init__(toy_placement(0, devices), ParallelConfig(devices=devices, tokens_per_step=64))

    def assign_requests(self, token_ids, offsets, prefill_len):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(5), "the test never released the decision"
        return np.full(len(offsets) - 1, self.rank, dtype=np.int64)


@pytest.fixture
def served():
    stops = []

    def start(plan: Plan):
        log: list = []
        upstream, stop_upstream = serve_in_thread(fake_upstream(log))
        router = SemanticRouter(plan, None)
        url, stop_router = serve_in_thread(build_app(router, [upstream], "sglang"))
        stops.extend([stop_router, stop_upstream])
        return url, log, router

    yield start
    for stop in stops:
        stop()


def test_in_flight_requests_keep_their_rank_and_new_ones_take_the_new_plan(served):
    url, log, router = served(OneRank(1))

    async def run():
        async with aiohttp.ClientSession() as session:
            async def post(i: int, sleep: float = 0.0):
                body = {"input_ids": [1, 2, 3], "id": i, "sleep": sleep}
                async with session.post(url + "/generate", json=body) as response:
                    return response.status, json.loads(await response.read())

            # 8 requests the upstream holds for 0.5 s: dispatched to rank 1 before the swap, answered after it
            slow = [asyncio.create_task(post(i, sleep=0.5)) for i in range(8)]
            while len(log) < 8:  # every one has reached the upstream
                await asyncio.sleep(0.01)
            await asyncio.get_running_loop().run_in_executor(None, router.swap_plan, OneRank(3))
            fresh = await asyncio.gather(*(post(100 + i) for i in range(8)))
            return await asyncio.gather(*slow), fresh

    slow, fresh = asyncio.run(run())
    assert [status for status, _ in slow + fresh] == [200] * 16  # none dropped
    assert [(echo["id"], rank_header(echo)) for _, echo in slow] == [(i, "1") for i in range(8)]
    assert [(echo["id"], rank_header(echo)) for _, echo in fresh] == [(100 + i, "3") for i in range(8)]
    assert sorted(log) == list(range(8)) + list(range(100, 108))  # the upstream saw each request once
    assert router.swaps == 1


def test_a_swap_waits_for_the_decision_in_progress_and_is_whole():
    gate = threading.Event()
    old = OneRank(1, gate=gate)
    router = SemanticRouter(old, None)
    decided: list[int] = []
    deciding = threading.Thread(target=lambda: decided.append(router.route(np.array([5, 6])).rank))
    deciding.start()
    assert old.entered.wait(5)  # the decision holds the routing lock, inside the old plan
    new = OneRank(2)
    swapping = threading.Thread(target=router.swap_plan, args=(new,))
    swapping.start()
    time.sleep(0.2)
    assert swapping.is_alive() and router.plan is old  # the swap waits; nothing is half swapped
    gate.set()
    deciding.join(5)
    swapping.join(5)
    assert decided == [1] and router.plan is new and router.route(np.array([5])).rank == 2


def test_routing_under_concurrent_swaps_never_mixes_two_plans():
    """8 threads route 150 requests each while a ninth swaps between two Sem-MoE plans 40 times; one plan knows
    a tenth of the other's vocabulary, so ids filtered by one plan and scored by the other would index outside it."""
    wide, narrow = semmoe_plan(0), semmoe_plan(1, vocab=VOCAB // 10)
    router = SemanticRouter(wide, None)
    errors: list[BaseException] = []
    ranks: list[int] = []
    guard = threading.Lock()

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                decision = router.route(router.token_ids(rng.integers(0, VOCAB, rng.integers(1, 40)).tolist()))
                assert 0 <= decision.rank < DEVICES
                assert decision.predicted_lar is None or 0.0 <= decision.predicted_lar <= 1.0
                with guard:
                    ranks.append(decision.rank)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    def swap() -> None:
        for i in range(40):
            router.swap_plan(narrow if i % 2 == 0 else wide)
            time.sleep(0.001)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)] + [threading.Thread(target=swap)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(ranks) == 8 * 150 and router.swaps == 40
    assert set(Counter(ranks)) <= set(range(DEVICES))


def test_a_plan_the_router_cannot_use_is_refused_and_the_old_one_stays(tmp_path, capsys):
    router = SemanticRouter(semmoe_plan(), None)
    before = router.plan
    with pytest.raises(ConfigError, match="keep the ranks"):
        router.swap_plan(OneRank(0, devices=2))
    with pytest.raises(ConfigError, match="dp_assign=online"):
        router.swap_plan(semmoe_plan(dp_assign="batch_window"))
    assert router.plan is before and router.swaps == 0
    # the CLI's SIGHUP handler re-reads --plan: a good folder is swapped in, a broken one refused with one line
    job = write_job(tmp_path / "job", OneRank(2))
    args = argparse.Namespace(plan=job, ep_size=None)
    assert reload_plan(router, args) and router.swaps == 1 and router.route(np.array([1])).rank in range(DEVICES)
    (job / "plan" / "physical_to_logical.npy").write_bytes(b"not an array")
    assert not reload_plan(router, args) and router.swaps == 1
    err = capsys.readouterr().err
    assert "error: plan reload refused, the current plan stays" in err and err.count("\n") == 2

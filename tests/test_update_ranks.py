"""One update whatever the number of ranks: the RL update and the SFT step on 2 gloo ranks whose shares are very
unequal (one holds 3x the other's samples) equal the same update on 1 rank holding them all, optimizer step count
and parameters, and the mini-batches are those of one shared shuffle (distributed.global_mini_batches).
torchrun runs this file as its worker."""
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
from harness import tiny  # noqa: E402
from harness.sft import sft_loss_backward  # noqa: E402
from infra import distributed as D  # noqa: E402

ARGS = T.Args(tiny_hidden=32, c_kl=0.0, c_ent=0.01, micro_batch=2, mini_batch=4, drop_zero_adv=False, alpha=0.0)


def _samples() -> list:
    """16 RL samples of mixed lengths: rank 0 of 2 holds the first 12, rank 1 the last 4."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(16):
        p, r = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        out.append(T.Sample(torch.randint(1, 50, (p,), generator=g).tolist(),
                            torch.randint(1, 50, (r,), generator=g).tolist(),
                            float(torch.randn(1, generator=g)), -torch.rand(r, generator=g) * 3,
                            skill=k % 5 == 4))
    return out


def _sft_pairs() -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(1, 50, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist(),
             torch.randint(1, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
            for _ in range(8)]


def _model():
    torch.manual_seed(0)
    return tiny.tiny_model(50, ARGS)


def _rl_update(samples: list):
    model = D.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    random.seed(0)                                     # rank 0's draw seeds the shared shuffle
    metrics = T.update(model, opt, samples, T.UpdateConfig.from_args(ARGS), pad_id=0, device="cpu", use_teacher=False)
    steps = int(next(iter(opt.state.values()))["step"])
    return D.full_state(model), steps, metrics


def _sft_step(pairs: list):
    model = D.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = sft_loss_backward(model, pairs, 0, "cpu", 0)
    opt.step()
    return D.full_state(model), loss


GAMES = sorted(str(g) for g in (ROOT / "data/alfworld/json_2.1.1/valid_unseen").glob("*/*/game.tw-pddl"))[:12]


def _greedy_eval(folder: Path) -> tuple[dict, dict]:
    """A fixed tiny checkpoint's greedy evaluation (constrained decoding, 1 episode a game, 4 turns)."""
    from transformers import AutoModelForCausalLM
    from envs import EnvPool
    from rollout import HFEngine, evaluate, load_tokenizer
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(folder).eval(), load_tokenizer(str(folder)),
                      max_new_tokens=24)
    pool = EnvPool(num_workers=1, max_steps=4)
    try:
        return evaluate(engine, pool, GAMES, repeats=1, seed=0, history_len=2, temperature=0, constrained=True)
    finally:
        pool.close()


def _worker(out: Path):
    D.setup()
    samples, pairs = _samples(), _sft_pairs()
    state, steps, metrics = _rl_update(samples[:12] if D.RANK == 0 else samples[12:])
    sft_state, sft = _sft_step(pairs[:6] if D.RANK == 0 else pairs[6:])     # 6 against 2
    ev, by_game = _greedy_eval(out / "m")                                  # each rank plays half the games
    if D.RANK == 0:
        torch.save({"rl": state, "steps": steps, "metrics": metrics, "sft": sft_state, "sft_loss": sft,
                    "eval": ev, "by_game": by_game}, out / "two_ranks.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_unequal_ranks_update_as_one_rank_with_every_sample(tmp_path):
    from test_skill_probe import _tiny_model
    _tiny_model(GAMES, tmp_path / "m")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
           __file__, str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = torch.load(tmp_path / "two_ranks.pt", weights_only=False)
    state, steps, metrics = _rl_update(_samples())
    # 16 samples in mini-batches of 4: 4 optimizer steps on either world size (cut per rank it was 6: 12 / 2)
    assert steps == two["steps"] == 4 == metrics["update/mini_batches"] == two["metrics"]["update/mini_batches"]
    assert metrics["update/samples"] == two["metrics"]["update/samples"] == 16
    start = _model().state_dict()
    for k, v in state.items():            # the same update: the two differ by float rounding only, which AdamW
        step = float((v - start[k]).abs().max())   # scales up where a gradient is tiny (0.05% of the step here),
        assert float((v - two["rl"][k]).abs().max()) <= 1e-3 * step + 1e-7, k   # where another update differs by ~100%
    assert any(not torch.equal(v, start[k]) for k, v in state.items())   # it did train
    sft_state, sft = _sft_step(_sft_pairs())
    assert sft == pytest.approx(two["sft_loss"], rel=1e-5)                 # the token mean over all 8 samples
    for k, v in sft_state.items():
        assert torch.allclose(v, two["sft"][k], atol=1e-5, rtol=0), k
    # greedy held-out outcomes game by game: the same on 1 rank (all 12 games in one batch) as on 2 (6 each),
    # or a near-tie that float noise of another batch could flip
    ev, by_game = _greedy_eval(tmp_path / "m")
    assert ev["eval/episodes"] == two["eval"]["eval/episodes"] == len(GAMES)
    assert by_game == two["by_game"] or ev["eval/near_ties"] + two["eval"]["eval/near_ties"] > 0


def test_greedy_episodes_are_the_same_at_batch_8_and_64_or_a_near_tie_explains_them(tmp_path):
    from test_skill_probe import _tiny_model
    from transformers import AutoModelForCausalLM
    from envs import EnvPool
    from rollout import NEAR_TIE, HFEngine, load_tokenizer, run_episodes
    _tiny_model(GAMES, tmp_path / "m")
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval(), load_tokenizer(str(tmp_path / "m")),
                      max_new_tokens=24)
    pool = EnvPool(num_workers=1, max_steps=4)
    runs = {}
    try:
        for batch in (64, 8):               # 24 prompts a turn: one batch, or three
            engine.batch_size = batch
            runs[batch] = run_episodes(engine, pool, [{"gamefile": g} for g in GAMES], 2, history_len=2,
                                       greedy=True, constrained=True)
    finally:
        pool.close()
    assert len(runs[8]) == 24 and all(e.turns for e in runs[8])
    for a, b in zip(runs[64], runs[8]):
        same = [tr.response_ids for tr in a.turns] == [tr.response_ids for tr in b.turns]
        assert same or min(a.min_margin, b.min_margin) < NEAR_TIE, (a.task_id, a.min_margin, b.min_margin)
        assert math.isfinite(a.min_margin) and a.min_margin >= 0


def test_global_mini_batches_on_one_rank_is_one_shuffle_cut_in_order():
    items = list("abcdefghij")
    minis, n = D.global_mini_batches(items, [1] * 10, 4, seed=3)
    order = list(range(10))
    random.Random(3).shuffle(order)
    assert n == 10 and minis == [[items[i] for i in order[s:s + 4]] for s in (0, 4, 8)]
    assert D.global_mini_batches([], [], 4, seed=3) == ([], 0)


def test_global_mini_batches_deal_each_mini_batch_equally_over_ranks(monkeypatch):
    # what two ranks would each compute, from the same gathered lengths: rank 0 holds 6 items, rank 1 holds 2
    lengths = {0: [5, 1, 7, 2, 9, 3], 1: [4, 8]}
    parts = {}
    for rank in (0, 1):
        calls = []

        def gather(x, rank=rank):          # the two ranks' values: lengths first, then the items each sends
            calls.append(x)
            if len(calls) == 1:
                return [lengths[0], lengths[1]]
            other = [(r, i, f"{r}:{i}") for r in (0, 1) if r != rank for i in range(len(lengths[r]))]
            return [x, other] if rank == 0 else [other, x]
        monkeypatch.setattr(D, "all_gather_obj", gather)
        monkeypatch.setattr(D, "RANK", rank)
        monkeypatch.setattr(D, "WORLD", 2)
        parts[rank] = D.global_mini_batches([f"{rank}:{i}" for i in range(len(lengths[rank]))], lengths[rank], 4, 7)[0]
    order = list(range(8))
    random.Random(7).shuffle(order)
    owners = [f"{r}:{i}" for r in (0, 1) for i in range(len(lengths[r]))]
    for m, start in enumerate((0, 4)):
        want = {owners[g] for g in order[start:start + 4]}
        got0, got1 = set(parts[0][m]), set(parts[1][m])
        assert got0 | got1 == want and not got0 & got1 and len(got0) == len(got1) == 2, m


if __name__ == "__main__":   # torchrun worker of test_two_unequal_ranks_update_as_one_rank_with_every_sample
    _worker(Path(sys.argv[1]))
    D.exit_process(0)

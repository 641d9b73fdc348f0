"""Rollout: the HF engine (left padding, stop, constrained decoding) and the lock-step episode loop
on the real ALFWorld engine, with a tiny randomly initialised Qwen2 and the project's tokenizer."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
import rollout as R  # noqa: E402
from harness import tiny as tiny_preset  # noqa: E402
from infra.env_backends import list_games  # noqa: E402
from envs import EnvPool, format_action, parse_action  # noqa: E402
from rollout import HFEngine, run_episodes, chat_ids, _PrefixTrie  # noqa: E402

DATA = str(ROOT / "data" / "alfworld")


@pytest.fixture(scope="module")
def tiny():
    games = list_games(DATA, "train")[:12]
    pairs = tiny_preset.walkthrough_samples(games, 2)
    tok = tiny_preset.train_tiny_tokenizer([p + " " + r for p, r in pairs] + ["user assistant"])
    torch.manual_seed(0)
    model = tiny_preset.tiny_model(len(tok), T.Args()).eval()
    return tok, model, pairs


def test_chat_template_and_tokenizer_roundtrip(tiny):
    tok, _, pairs = tiny
    ids = chat_ids(tok, "go to desk 1")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|> user go to desk 1 <|im_end|>") and text.endswith("<|im_start|> assistant")
    assert tok.unk_token_id not in ids
    r = tok.encode(pairs[0][1], add_special_tokens=False)
    assert parse_action(tok.decode(r)) == parse_action(pairs[0][1])


def test_prefix_trie():
    trie = _PrefixTrie([[1, 2, 3], [1, 4]], end_id=9)
    assert sorted(trie.allowed([])) == [1]
    assert sorted(trie.allowed([1])) == [2, 4]
    assert trie.allowed([1, 4]) == [9]      # a complete sequence may only end
    assert trie.allowed([7]) == [9]         # off the trie: end


def test_batched_greedy_equals_one_by_one(tiny):
    # Left padding must not change what a prompt generates (greedy, so it is deterministic).
    tok, model, pairs = tiny
    eng = HFEngine(model, tok, max_new_tokens=6)
    prompts = [pairs[0][0], pairs[5][0][:200], "go to"]
    batched = eng.generate(prompts, greedy=True, stop=False)
    single = [eng.generate([p], greedy=True, stop=False)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    assert all(len(g.token_ids) == 6 and len(g.logprobs) == 6 for g in batched)
    assert all(lp <= 0 for g in batched for lp in g.logprobs)


def test_constrained_decoding_yields_admissible_actions(tiny):
    tok, model, pairs = tiny
    eng = HFEngine(model, tok, max_new_tokens=24, temperature=1.0)
    acts = [["go to desk 1", "go to bed 1", "look"], ["inventory"]]
    torch.manual_seed(1)
    gens = eng.generate(["a", "b"], allowed_responses=[[format_action(a) for a in x] for x in acts])
    for g, allowed in zip(gens, acts):
        assert parse_action(g.text) in allowed
        assert g.token_ids[-1] == tok.convert_tokens_to_ids("</action>")  # stopped at the action end


def test_run_episodes_lockstep_on_real_engine(tiny):
    tok, model, _ = tiny
    eng = HFEngine(model, tok, max_new_tokens=16, temperature=1.0)
    games = list_games(DATA, "valid_unseen")[:2]
    torch.manual_seed(0)
    with EnvPool(num_workers=2, max_steps=3) as pool:
        eps = run_episodes(eng, pool, [{"gamefile": g} for g in games], 3, history_len=2,
                           constrained=True, group_offset=10)
    assert len(eps) == 6 and [e.group_id for e in eps] == [10, 10, 10, 11, 11, 11]
    for e in eps:
        assert 1 <= len(e.turns) <= 3 and len(e.steps) == len(e.turns)
        assert e.error is None and e.task
        for t in e.turns:
            assert len(t.sampler_logprobs) == len(t.response_ids) > 0
            assert t.invalid == (parse_action(t.response_text) is None)
            assert f"Your task is to: {e.task}" in t.prompt_text
    # N copies of a task start from the same state: identical first prompts within a group.
    assert len({e.turns[0].prompt_text for e in eps[:3]}) == 1
    assert eps[0].turns[0].prompt_text != eps[3].turns[0].prompt_text
    # A skill given for a task is inserted after its task line in every prompt.
    with EnvPool(num_workers=1, max_steps=1) as pool:
        eps = run_episodes(eng, pool, [{"gamefile": games[0]}], 1, skills={0: "open things first"},
                           constrained=True)
    lines = eps[0].turns[0].prompt_text.splitlines()
    k = next(i for i, l in enumerate(lines) if l.startswith("Your task is to: "))
    assert lines[k + 1] == "Skill for this task: [open things first]"


def test_evaluation_uses_common_random_numbers(tiny, monkeypatch):
    """Two evaluations of one policy draw the same episodes, whatever the training RNG did in between,
    and evaluating leaves the training RNG where it was."""
    tok, model, _ = tiny
    eng = HFEngine(model, tok, max_new_tokens=16, temperature=1.0)
    games = list_games(DATA, "valid_unseen")[:2]
    seen = []

    def spy(*a, **k):
        eps = run_episodes(*a, **k)
        seen.append([[a for _, a in e.steps] for e in eps])
        return eps

    monkeypatch.setattr(R, "run_episodes", spy)
    with EnvPool(num_workers=1, max_steps=4) as pool:
        for seed in (1, 2):
            torch.manual_seed(seed)          # a different training-RNG state before each evaluation
            before = torch.get_rng_state()
            out, by_game = R.evaluate(eng, pool, games, repeats=3, seed=0, history_len=2, temperature=1.0,
                                      constrained=True)
            assert torch.equal(torch.get_rng_state(), before)   # the training RNG is untouched
            assert out["eval/episodes"] == 6
            # two games x 3 repeats: per-game means average back to the overall success
            assert len(by_game) == 2
            assert sum(by_game.values()) / 2 == pytest.approx(out["eval/success"])
        torch.manual_seed(3)                 # the same draws without the fixed seed differ (T = 1, random policy)
        eps = run_episodes(eng, pool, [{"gamefile": g} for g in games], 3, history_len=2, temperature=1.0,
                           constrained=True)
    assert seen[0] == seen[1]
    assert [[a for _, a in e.steps] for e in eps] != seen[0]


def test_prompts_drop_history_to_fit_and_an_unfittable_turn_is_invalid_not_a_crash(tiny):
    tok, model, _ = tiny
    games = list_games(DATA, "valid_unseen")[:1]
    eng = HFEngine(model, tok, max_new_tokens=8, temperature=1.0)
    with EnvPool(num_workers=1, max_steps=4) as pool:
        eps = run_episodes(eng, pool, [{"gamefile": games[0]}], 1, history_len=3, constrained=True, greedy=True)
        full = [eng.prompt_len(t.prompt_text) for t in eps[0].turns]
        # a budget that the later turns' prompts only meet with part of their history left out
        eng.max_prompt_tokens = full[2] - 1
        cut = run_episodes(eng, pool, [{"gamefile": games[0]}], 1, history_len=3, constrained=True, greedy=True)[0]
        # a budget no prompt meets: every turn is invalid (an empty action, counted), the episode still runs
        eng.max_prompt_tokens = 5
        none = run_episodes(eng, pool, [{"gamefile": games[0]}], 1, history_len=3, constrained=True)[0]
    assert full[2] > full[0]   # history makes later prompts longer
    assert cut.turns and len(cut.turns) + cut.overflow == len(cut.steps)
    for t in cut.turns:
        assert eng_len(tok, t.prompt_text) <= full[2] - 1
        assert "Your task is to: " in t.prompt_text and t.prompt_text.endswith("</action>.")
    shown = [t.prompt_text.count("[Observation") for t in cut.turns]
    assert any(n < min(t.step, 3) for n, t in zip(shown, cut.turns))   # some history was left out
    assert none.turns == [] and none.overflow == len(none.steps) == 4 and none.error is None
    assert all(a == "" for _, a in none.steps)


def eng_len(tok, prompt):
    return len(chat_ids(tok, prompt))


def test_collate_masks_exactly_the_response_tokens():
    ids, attn, tgt, mask = R.collate([([5, 6, 7], [8, 9]), ([5], [8])], pad_id=0, device="cpu")
    # prompts left-padded to P = 3, responses right-padded to R = 2: both responses start at column 3
    assert ids.tolist() == [[5, 6, 7, 8, 9], [0, 0, 5, 8, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    # targets are the response tokens; the mask marks exactly them
    assert tgt.tolist() == [[8, 9], [8, 0]] and mask.tolist() == [[1, 1], [1, 0]]


def test_response_logprobs_equal_the_full_forward_of_each_sequence_alone():
    # logits at the response positions only (left-padded prompts, explicit positions) must give the same
    # log-probs as a plain forward of each unpadded sequence: the trainer's ℓ is what the sampler saw
    torch.manual_seed(0)
    model = tiny_preset.tiny_model(50, T.Args(tiny_hidden=32)).eval()
    samples = [([1, 2, 3, 4, 5, 6], [7, 8]), ([9, 3], [4, 5, 6, 7]), ([2], [3])]
    ids, attn, tgt, mask = R.collate(samples, pad_id=0, device="cpu")
    lp, ent = R.token_logprobs_of(model, ids, attn, tgt, with_entropy=True)
    assert lp.shape == (3, 4) and ent.shape == (3, 4)
    for b, (p, r) in enumerate(samples):
        x = torch.tensor([p + r])
        full = model(input_ids=x).logits[0].log_softmax(-1)                     # [len, V]
        ref = full[len(p) - 1:len(p) - 1 + len(r)].gather(-1, torch.tensor(r)[:, None])[:, 0]
        assert torch.allclose(lp[b, :len(r)], ref, atol=1e-5), b
        h = -(full.exp() * full).sum(-1)[len(p) - 1:len(p) - 1 + len(r)]
        assert torch.allclose(ent[b, :len(r)], h, atol=1e-5), b


def test_paired_gain_over_games():
    # d = (1/3 − 0, 1 − 2/3, 0 − 0, 2/3 − 1/3) = (1/3, 1/3, 0, 1/3); game "x" was played once only
    start = {"a": 0.0, "b": 2 / 3, "c": 0.0, "d": 1 / 3, "x": 1.0}
    end = {"a": 1 / 3, "b": 1.0, "c": 0.0, "d": 2 / 3}
    g, se, n = R.paired_gain(start, end)
    assert n == 4 and g == pytest.approx(0.25)
    # deviations (1/12, 1/12, −1/4, 1/12): Σ² = 3/144 + 9/144 = 1/12; var = (1/12)/3 = 1/36; se = (1/6)/2
    assert se == pytest.approx(1 / 12)
    assert R.paired_gain({"a": 0.5}, {"a": 1.0})[:1] == (0.5,) and R.paired_gain({}, {})[2] == 0


def test_score_tokens_keeps_no_graph():
    # old / reference / teacher log-probs are constants of the update (METHOD.md §2.7, Eq. 10-11): scoring
    # with a model whose parameters require grad must return tensors without a graph (a kept graph per
    # turn exhausted 24 GB in the skill probe)
    torch.manual_seed(0)
    model = tiny_preset.tiny_model(50, T.Args(tiny_hidden=32))
    assert all(p.requires_grad for p in model.parameters())
    out = R.score_tokens(model, [([1, 2, 3], [4, 5]), ([1], [6, 7, 8])], pad_id=0, device="cpu", micro_batch=1)
    assert [o.shape[0] for o in out] == [2, 3]
    assert not any(o.requires_grad for o in out) and all(o.grad_fn is None for o in out)


def test_score_tokens_keeps_the_top_ids_a_support_or_the_whole_distribution_with_the_same_logprobs():
    # plain scoring has no [B, R, V] log-softmax; `top` adds the K most likely ids; `support` "vocab" the whole
    # log-softmax, a function of (sample, log-softmax) its ids with their log-probs and the exact tail: the sampled
    # tokens' log-probs are the same in all, and each kept part agrees with the whole distribution
    torch.manual_seed(0)
    model = tiny_preset.tiny_model(50, T.Args(tiny_hidden=32))
    pairs = [([1, 2, 3], [4, 5]), ([1], [6, 7, 8])]
    kw = dict(pad_id=0, device="cpu", micro_batch=2, temperature=0.7)
    plain = R.score_tokens(model, pairs, **kw)
    top = R.score_tokens(model, pairs, top=3, **kw)
    full = R.score_tokens(model, pairs, support="vocab", **kw)
    seen = []
    picked = R.score_tokens(model, pairs, support=lambda i, row: seen.append(i) or row.topk(4, dim=-1).indices, **kw)
    assert sorted(seen) == [0, 1]
    for (_, r), lp, (lp_k, ids), (lp_f, whole), (lp_s, kept) in zip(pairs, plain, top, full, picked):
        all_lp = whole.lp
        assert all(torch.allclose(lp, x, atol=1e-6) for x in (lp_k, lp_f, lp_s)) and whole.ids is None
        assert ids.shape == (len(r), 3) and all_lp.shape == (len(r), 50) and whole.tail is None
        assert torch.allclose(all_lp.exp().sum(-1), torch.ones(len(r)), atol=1e-5)
        assert torch.allclose(all_lp.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1), lp, atol=1e-6)
        assert torch.equal(all_lp.topk(3, dim=-1).indices.int(), ids)
        assert torch.equal(kept.ids, all_lp.topk(4, dim=-1).indices.int())
        assert torch.allclose(kept.lp, all_lp.topk(4, dim=-1).values, atol=1e-6)
        assert torch.allclose(kept.tail.exp() + kept.lp.exp().sum(-1), torch.ones(len(r)), atol=1e-5)


def test_tokenizer_without_chat_template_or_pad_token(tmp_path):
    from transformers import PreTrainedTokenizerFast
    tok = tiny_preset.train_tiny_tokenizer(["go to desk 1 <|endoftext|>"], extra_specials=["<|endoftext|>"])
    tok.pad_token = tok.eos_token                      # pad = EOS, as SmolLM2 ships
    tok.save_pretrained(tmp_path / "ok")
    back = R.load_tokenizer(str(tmp_path / "ok"))
    assert back.pad_token == "<|endoftext|>" and back.pad_token_id != back.eos_token_id   # a pad that is not EOS
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    for f in ("chat_template.jinja",):
        (tmp_path / "plain" / f).unlink(missing_ok=True)
    cfg = json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="--model .* no chat template"):
        R.load_tokenizer(str(tmp_path / "plain"))
    from tokenizers import Tokenizer, models
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<|im_end|>": 1}, "a")),
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")   # nothing else to pad with
    with pytest.raises(SystemExit, match="no pad token other than EOS"):
        R.ensure_pad(bare, "m")


def test_sampler_gap_over_tokens_and_none_without_tokens():
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    sampler = [[-1.0, -2.5], [-0.25]]
    g = R.sampler_gap(list(zip(old, sampler)))
    # |Δ| = 0, 0.5, 0.25 → max 0.5, mean 0.25 over 3 tokens
    assert g == {"rollout/logp_diff_max": 0.5, "rollout/logp_diff_mean": 0.25, "rollout/logp_diff_tokens": 3}
    assert R.sampler_gap([]) == {}

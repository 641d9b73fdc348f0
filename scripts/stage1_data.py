"""Stage-1 data from nothing: the warm start's SFT file (recipes/README.md, stage 1), made with the base model itself.

As SEED's stage 1 does, with no hand-written data: the base model plays the training games (the trainer's own
set-up: vLLM on GPUs under torchrun, Hugging Face generation on CPU), an analyzer writes one skill per episode
with the trainer's analyzer prompt (Eq. 2: a workflow after a win, avoidance rules after a loss), and the
format-valid annotations are kept: a skill that parses (`skills.parse_skill`, which forgives reasoning, fences
and stray text; one retry of those that do not) and names its task's object and target (`skills.names_task`).
Two kinds of chat samples come out, the ones `train.py --sft_data` reads:

* skill writing: the analyzer prompt of an episode → {"skill": "<its annotation>"} (what the warm start learns
  to write);
* skill-conditioned acting: each turn of a won episode, its prompt with the annotation inserted after the task
  line (`skills.insert_skill`, where the teacher and the replays put it) → the action the episode took.

The analyzer (`--analyzer`): `policy` (the model that played, as RSIPO's own skill writer), a local Hugging Face
model folder (`--analyzer path/to/model`), or an OpenAI-compatible endpoint (`--analyzer_url
http://host:8000/v1 --analyzer_model NAME`, the key from the variable `--api_key_env` names; SEED's o3 or Gemini
annotations are this case). The counts (episodes, won, annotated, valid, kept, samples of each kind) are printed
and written beside the file as <out>.json.

    python scripts/stage1_data.py --out runs/skill_sft.jsonl -- --data_root data/alfworld --episodes 2
    torchrun --nproc_per_node 8 scripts/stage1_data.py --out skill_sft.jsonl -- --engine vllm \\
        --model Qwen/Qwen2.5-7B-Instruct --data_root ~/.cache/alfworld --episodes 4
    python scripts/stage1_data.py --analyzer_url http://127.0.0.1:8000/v1 --analyzer_model gpt-4o-mini \\
        --out runs/skill_sft.jsonl -- --model Qwen/Qwen2.5-3B-Instruct

Flags after `--` are train.py's (the model, the data, the engine, the prompt budget, --temperature,
--skill_temperature, --max_turns, ...), so the episodes are played exactly as RL plays them. Test:
pytest tests/test_stage1_data.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.config import parse_args  # noqa: E402
from harness.run import build_policy, setup, teardown  # noqa: E402
from infra import distributed as D  # noqa: E402
from infra.distributed import all_gather_obj, print0  # noqa: E402
from rollout import run_episodes, task_line  # noqa: E402
from skills import insert_skill, names_task, parse_skill  # noqa: E402


def chat(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


class EndpointAnalyzer:
    """An OpenAI-compatible chat endpoint (POST <url>/chat/completions) as the analyzer: one request per prompt,
    `generate`'s interface (texts in, objects with `.text` out). A request that fails is retried once, then its
    answer is empty (no annotation, counted)."""

    def __init__(self, url: str, model: str, api_key: str = "", temperature: float = 0.7, max_tokens: int = 256,
                 timeout: float = 120.0):
        self.url, self.model, self.key = url.rstrip("/") + "/chat/completions", model, api_key
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout
        self.failed = 0

    def ask(self, prompt: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        for attempt in range(2):
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())["choices"][0]["message"]["content"] or ""
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                if attempt:
                    self.failed += 1
                    print(f"analyzer request failed twice ({type(e).__name__}: {e}); no annotation", flush=True)
        return ""

    def generate(self, prompts: list[str], **kw) -> list:
        return [type("Answer", (), {"text": self.ask(p)})() for p in prompts]


def analyzer_of(a, run):
    """The analyzer `a` names: the policy's own engine, a local model's, or an endpoint."""
    if a.analyzer_url:
        key = os.environ.get(a.api_key_env, "") if a.api_key_env else ""
        return EndpointAnalyzer(a.analyzer_url, a.analyzer_model, key, run.args.skill_temperature,
                                max_tokens=run.skill_max_tokens)
    if a.analyzer == "policy":
        return run.engine
    from transformers import AutoModelForCausalLM
    from rollout import HFEngine, load_tokenizer
    if not (Path(a.analyzer) / "config.json").exists():
        raise SystemExit(f"error: --analyzer {a.analyzer}: 'policy', or a Hugging Face model folder (no config.json "
                         "there)")
    model = AutoModelForCausalLM.from_pretrained(a.analyzer).to(run.device).eval()
    return HFEngine(model, load_tokenizer(a.analyzer), max_new_tokens=run.skill_max_tokens,
                    max_prompt_tokens=run.args.max_prompt_tokens)


def annotate(analyzer, episodes, run) -> list:
    """One skill per episode (None where none is format-valid): the analyzer prompt of the trainer
    (`train.analyzer_prompt_fit`: the latest steps that fit the prompt budget), the skill parsed, one retry of
    the answers that do not parse or do not name their task's object and target."""
    from train import analyzer_prompt_fit
    a = run.args
    budget = a.max_prompt_tokens if run.engine is None else run.engine.max_prompt_tokens
    prompts = [analyzer_prompt_fit(run.engine, e, a.skill_max_words, budget) if run.engine is not None
               else None for e in episodes]
    skills = [None] * len(episodes)
    for _ in range(2):
        todo = [k for k, p in enumerate(prompts) if p is not None and skills[k] is None]
        answers = analyzer.generate([prompts[k] for k in todo], temperature=a.skill_temperature,
                                    max_new_tokens=run.skill_max_tokens, stop=False) if todo else []
        for k, ans in zip(todo, answers):
            skill = parse_skill(ans.text, a.skill_max_words)
            if skill and names_task(skill, run.pool.task_terms(episodes[k].task)):
                skills[k] = skill
    return prompts, skills


def samples_of(run, episodes, prompts, skills) -> tuple[list[dict], list[dict]]:
    """The skill-writing samples of the annotated episodes, and the skill-conditioned acting samples of the won
    ones (each turn's prompt with its skill inserted → the action it took)."""
    writing, acting = [], []
    for e, p, skill in zip(episodes, prompts, skills):
        if skill is None:
            continue
        writing.append(chat(p, json.dumps({"skill": skill})))
        if e.won:
            line = task_line(run.pool, e.task)
            acting += [chat(insert_skill(t.prompt_text, skill, line), t.response_text) for t in e.turns
                       if not t.invalid]
    return writing, acting


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSONL to write (train.py --sft_data); its counts go to <out>.json")
    p.add_argument("--episodes", type=int, default=2, help="episodes per training task")
    p.add_argument("--tasks", type=int, default=0, help="training tasks to play (0 = all)")
    p.add_argument("--analyzer", default="policy", help="policy, or a local Hugging Face model folder")
    p.add_argument("--analyzer_url", default="", help="an OpenAI-compatible endpoint (…/v1) as the analyzer")
    p.add_argument("--analyzer_model", default="", help="the endpoint's model name")
    p.add_argument("--api_key_env", default="", help="the environment variable that holds the endpoint's key")
    a = p.parse_args(own)
    if a.analyzer_url and not a.analyzer_model:
        p.error("--analyzer_url needs --analyzer_model")
    args = parse_args(["--steps", "1", "--eval", "false", "--sft_steps", "0", "--save_every", "0", "--check_disk",
                       "false", "--run_name", "stage1_data", "--resume", "false", *train_flags])
    t0, run = time.time(), None
    try:
        run = setup(args)
        build_policy(run)
        if run.engine is None:
            raise SystemExit("error: no engine to play the games with")
        tasks = run.data.train[:a.tasks] if a.tasks else run.data.train
        mine = [{run.pool.task_key: t} for t in tasks[D.RANK::D.WORLD]]
        episodes = [e for e in run_episodes(run.engine, run.pool, mine, a.episodes, history_len=args.history_len,
                                            temperature=args.temperature, constrained=args.constrained)
                    if e.error is None]
        prompts, skills = annotate(analyzer_of(a, run), episodes, run)
        writing, acting = samples_of(run, episodes, prompts, skills)
        counts = {"episodes": len(episodes), "won": sum(e.won for e in episodes),
                  "annotated": sum(p is not None for p in prompts), "kept": sum(s is not None for s in skills),
                  "kept_won": sum(s is not None and e.won for s, e in zip(skills, episodes))}
        parts = all_gather_obj((writing, acting, counts))
    finally:
        teardown(run)
    if D.RANK == 0:
        writing = [x for w, _, _ in parts for x in w]
        acting = [x for _, ac, _ in parts for x in ac]
        counts = {k: sum(c[k] for _, _, c in parts) for k in parts[0][2]}
        counts.update({"skill_writing_samples": len(writing), "acting_samples": len(acting),
                       "seconds": round(time.time() - t0, 1), "analyzer": a.analyzer_url or a.analyzer,
                       "train_flags": train_flags})
        if not writing:
            raise SystemExit(f"error: no format-valid annotation in {counts['episodes']} episodes ({counts}): "
                             "nothing to write; try another --analyzer or more --episodes")
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(x) + "\n" for x in writing + acting))
        out.with_suffix(out.suffix + ".json").write_text(json.dumps(counts, indent=1))
        print0(f"{counts['episodes']} episodes ({counts['won']} won), {counts['kept']} format-valid annotations: "
               f"{len(writing)} skill-writing and {len(acting)} acting samples → {out}")
    return counts if D.RANK == 0 else None


if __name__ == "__main__":
    main()

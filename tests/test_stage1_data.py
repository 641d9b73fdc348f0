"""scripts/stage1_data.py end to end on CPU: the tiny model plays the clean games, an analyzer annotates each
episode, and the file it writes is what `train.py --sft_data` trains on. The analyzer is an OpenAI-compatible
endpoint served here over HTTP in the protocol's own format (its first answer to each prompt unparsable, as an
LLM's sometimes is, so the retry is exercised), and the policy itself (a random tiny model writes no valid skill:
the script says so and writes nothing)."""
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import envs  # noqa: E402
import stage1_data  # noqa: E402
import train as T  # noqa: E402
from harness.sft import load_sft_jsonl  # noqa: E402
from skills import ANALYZER_HEAD, SKILL_PREFIX  # noqa: E402

PLAY = ["--", "--data_root", "data/alfworld_clean", "--preset", "none", "--tiny_hidden", "32", "--max_turns", "6",
        "--constrained", "true", "--env_workers", "1"]


def _terms(prompt: str) -> tuple[str, str]:
    """The object and target of the task line of an analyzer prompt."""
    return envs.task_terms(re.search(r"^Task: (.+)$", prompt, re.M)[1])


class Endpoint(BaseHTTPRequestHandler):
    """/v1/chat/completions: the first request for a prompt gets prose with no JSON, the second a skill in a fenced
    block after some reasoning, naming the task's object and target."""
    seen: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        obj, target = _terms(prompt)
        n = Endpoint.seen[prompt] = Endpoint.seen.get(prompt, 0) + 1
        text = ("Let me think about this episode." if n == 1 else
                f'<think>the sink cleans it</think> ```json\n{{"skill": "take the {obj}, clean the {obj} '
                f'at the sinkbasin, then put the {obj} in the {target}."}}\n```')
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                          "model": body["model"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def test_stage1_data_from_an_endpoint_analyzer_trains_a_warm_start(tmp_path, endpoint):
    out = tmp_path / "skill_sft.jsonl"
    counts = stage1_data.main(["--out", str(out), "--tasks", "3", "--episodes", "2", "--analyzer_url", endpoint,
                               "--analyzer_model", "stub", *PLAY, "--out_dir", str(tmp_path)])
    assert counts["episodes"] == 6 and counts["annotated"] == 6 and counts["kept"] == 6   # each after one retry
    assert all(n == 2 for n in Endpoint.seen.values())
    pairs = load_sft_jsonl(str(out))
    writing = [(p, r) for p, r in pairs if p.startswith(ANALYZER_HEAD)]
    acting = [(p, r) for p, r in pairs if not p.startswith(ANALYZER_HEAD)]
    assert len(writing) == 6 and counts["skill_writing_samples"] == 6 and len(acting) == counts["acting_samples"]
    for p, r in writing:
        skill, (obj, target) = json.loads(r)["skill"], _terms(p)
        assert skill == f"take the {obj}, clean the {obj} at the sinkbasin, then put the {obj} in the {target}."
    for p, r in acting:                   # won turns, the skill after the task line, the action taken
        assert f"\n{SKILL_PREFIX}[take the" in p and "<action>" in r
    assert counts["kept_won"] == 0 or acting
    assert json.loads(out.with_suffix(".jsonl.json").read_text())["kept"] == 6
    # the file is what train.py --sft_data reads: stage 1 of the recipe, from it
    s = T.main(["--sft_data", str(out), "--sft_steps", "5", "--steps", "0", "--eval", "false", "--tiny_hidden", "32",
                "--out_dir", str(tmp_path), "--run_name", "ws"])
    assert s["sft/final_loss"] > 0 and (tmp_path / "ws" / "warm_start" / "config.json").exists()


def test_the_policy_as_analyzer_and_nothing_valid_is_said_so(tmp_path):
    # a random tiny model plays and annotates: it writes no parseable skill, and the script stops naming the counts
    with pytest.raises(SystemExit, match=r"no format-valid annotation in 4 episodes \(.*'annotated': 4, 'kept': 0"):
        stage1_data.main(["--out", str(tmp_path / "x.jsonl"), "--tasks", "2", "--episodes", "2", *PLAY,
                          "--out_dir", str(tmp_path)])
    assert not (tmp_path / "x.jsonl").exists()

"""Search QA (issue 5): answer normalisation, tag parsing with every bad input, the data loader,
BM25 on the shipped corpus, the env and its pool (incl. a retriever that hangs), the HTTP client
against a real loopback server, the generator, rollout wiring and a tiny `train.py --env search`.

Expected values are derived by hand in the comments. Run: python -m pytest -q tests/test_search.py
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from infra import env_backends  # noqa: E402
import envs  # noqa: E402
import qa_gen  # noqa: E402
import retrieval_server  # noqa: E402
from infra.env_backends import EnvDataError, RetrieverError, RetrieverTimeout  # noqa: E402
from envs import exact_match, normalize_answer, parse_search_action, split_search_action  # noqa: E402
from rollout import Generation, run_episodes  # noqa: E402

DATA = ROOT / "data" / "search_qa"
CORPUS = str(DATA / "corpus.jsonl")


@pytest.fixture(scope="module")
def bm25():
    return env_backends.BM25Retriever(CORPUS)


@pytest.fixture(scope="module")
def qa():
    return {r["id"]: r for split in ("train", "test") for r in env_backends.list_qa(str(DATA), split)}


# ---------------------------------------------------------------------------------------------
# Answers


@pytest.mark.parametrize("text, want", [
    ("The Eiffel Tower!", "eiffel tower"),        # lowercase, "!" dropped, article "the" dropped
    ("  A  cat's   toy. ", "cats toy"),           # apostrophe removed inside the word, spaces collapsed
    ("an apple an", "apple"),                     # articles anywhere, as whole words
    ("Theory", "theory"),                         # "the" inside a word stays
    ("U.S.A.", "usa"),                            # punctuation removed, not replaced by spaces
    ("Anne-Marie", "annemarie"),
    ("", ""),
    ("Zürich", "zürich"),                         # non-ASCII letters kept
])
def test_normalize_answer(text, want):
    assert normalize_answer(text) == want


def test_exact_match_against_any_gold():
    assert exact_match("the Beatles", ["Beatles"])
    assert exact_match("beatles.", "The Beatles")            # a single gold string works too
    assert exact_match("Ringo", ["John", "ringo"])           # any gold answer
    assert not exact_match("Beatle", ["Beatles"])
    assert not exact_match("", ["Beatles"])
    assert exact_match(" 1954 ", ["1954"])


# ---------------------------------------------------------------------------------------------
# Tags


@pytest.mark.parametrize("text, want", [
    ("<think> x </think> <search> who  is\nX </search>", ("search", "who is X")),   # whitespace collapsed
    ("<answer>Paris</answer>", ("answer", "Paris")),
    ("<SEARCH>q</Search>", ("search", "q")),                  # tags case-insensitive
    ("<answer> Zürich </answer>", ("answer", "Zürich")),      # non-ASCII: a normal turn
    ("<search> " + "a" * 300 + " </search>", ("search", "a" * 300)),   # at the limit: valid
    # invalid turns:
    ("<search> q", None),                                     # unclosed
    ("q </search>", None),                                    # closing tag only
    ("no tags at all", None),
    ("<search>a</search><search>b</search>", None),           # several actions
    ("<search>a</search> <answer>b</answer>", None),
    ("<search>a</search> <answer>b", None),                   # a second, unclosed action
    ("<search>a</answer>", None),                             # mismatched pair
    ("</search>a<search>", None),                             # closing before opening
    ("<search>   </search>", None),                           # empty query
    ("<answer></answer>", None),                              # empty answer
    ("<search> " + "a" * 301 + " </search>", None),           # huge query (> MAX_QUERY_CHARS = 300)
    ("<answer> " + "b" * 201 + " </answer>", None),           # huge answer (> MAX_ANSWER_CHARS = 200)
    (None, None),
])
def test_split_search_action(text, want):
    assert split_search_action(text) == want


def test_parse_search_action_is_canonical_and_idempotent():
    a = parse_search_action("<think>hm</think><search>  Marlo   Venn </search>")
    assert a == "<search> Marlo Venn </search>"
    assert parse_search_action(a) == a
    assert parse_search_action("<answer>x") is None


def test_prompt_history_and_question_line():
    h = [("", "<search> a </search>"), ("<information> A </information>", "<search> b </search>")]
    p = envs.build_search_prompt("Who  is\nit?", "<information> B </information>", [], h, history_len=1)
    lines = p.splitlines()
    assert lines[1] == "Question: Who is it?"                 # its own line, whitespace collapsed
    # H = 1 of 2 turns: turn 1 hidden, turn 2 with its result (the current observation)
    assert lines[2:] == ["(1 earlier turn(s) not shown)", "Turn 2: <search> b </search>",
                         "<information> B </information>", "Now write turn 3."]
    p = envs.build_search_prompt("q?", "<information> B </information>", [], h, history_len=4)
    assert "Turn 1: <search> a </search>\n<information> A </information>\nTurn 2:" in p
    # the skill goes right after the question line
    from skills import insert_skill
    assert insert_skill(p, "search first", "Question: q?").splitlines()[2] == "Skill for this task: [search first]"


# ---------------------------------------------------------------------------------------------
# Data


def _write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_qa_search_r1_layouts(tmp_path):
    p = _write(tmp_path / "test.jsonl", [
        # FlashRAG / flat layout
        {"id": "test_0", "question": " who wrote  x ", "golden_answers": ["A", "B"], "data_source": "nq"},
        # verl parquet layout (the question at the end of the prompt, targets in reward_model)
        {"data_source": "hotpotqa", "ability": "fact-reasoning",
         "prompt": [{"role": "user", "content": "Answer the given question. ... Question: Which city?\n"}],
         "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris"]}},
         "extra_info": {"split": "test", "index": 7}},
        {"id": "test_0", "question": "q", "golden_answers": "solo", "data_source": "bamboogle"},
    ])
    rows = env_backends.load_qa(p)
    assert rows[0] == {"id": "nq:test_0", "question": "who wrote x", "golden_answers": ["A", "B"],
                       "data_source": "nq", "task_type": "single"}
    assert rows[1]["id"] == "hotpotqa:test-7" and rows[1]["question"] == "Which city?"
    assert rows[1]["golden_answers"] == ["Paris"] and rows[1]["task_type"] == "multi"
    assert rows[2]["id"] == "bamboogle:test_0" and rows[2]["golden_answers"] == ["solo"]  # same raw id, other source
    assert ([r["id"] for r in env_backends.list_qa(str(tmp_path), "test", ["multi"])]
            == ["hotpotqa:test-7", "bamboogle:test_0"])


@pytest.mark.parametrize("rows, match", [
    ([{"question": "q", "golden_answers": ["a"], "data_source": "nq"}, "{oops"], r"test.jsonl:2"),
    ([{"question": "q", "golden_answers": ["a"], "data_source": "webqa"}], r"test.jsonl:1 .* has data_source 'webqa'"),
    ([{"question": "q", "data_source": "nq"}], r"test.jsonl:1 .* has no 'golden_answers'"),
    ([{"golden_answers": ["a"], "data_source": "nq"}], r"test.jsonl:1 \(fields found: \['data_source', "
                                                       r"'golden_answers'\]\) has no 'question'; "
                                                       r"accepted layouts: FlashRAG"),
    ([{"id": 1, "question": "q", "golden_answers": ["a"], "data_source": "nq"}] * 2, r"repeated ids"),
])
def test_load_qa_errors_name_file_and_record(tmp_path, rows, match):
    with pytest.raises(EnvDataError, match=match):
        env_backends.load_qa(_write(tmp_path / "test.jsonl", rows))


def test_qa_split_and_type_errors(tmp_path):
    with pytest.raises(EnvDataError, match="no QA split file .*nope.jsonl"):
        env_backends.list_qa(str(tmp_path), "nope")
    with pytest.raises(EnvDataError, match="unknown search task types"):
        env_backends.list_qa(str(DATA), "test", ["pick"])
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(EnvDataError, match="needs pyarrow"):
            env_backends.load_qa(str(tmp_path / "x.parquet"))


def test_corpus_errors(tmp_path):
    with pytest.raises(EnvDataError, match="corpus .*missing.jsonl.* does not exist"):
        env_backends.load_corpus(str(tmp_path / "missing.jsonl"))
    ok = {"id": "a", "title": "T", "text": "x"}
    with pytest.raises(EnvDataError, match=r"c.jsonl:2: invalid JSON"):
        env_backends.load_corpus(_write(tmp_path / "c.jsonl", [ok, "{bad"]))
    with pytest.raises(EnvDataError, match=r"c.jsonl:2: a passage in no known layout "
                                           r"\(fields found: \['id', 'text'\]\); "
                                           r"accepted.*wiki-18.*pyserini"):
        env_backends.load_corpus(_write(tmp_path / "c.jsonl", [ok, {"id": "b", "text": "no title"}]))
    with pytest.raises(EnvDataError, match="c.jsonl:2: repeats passage id 'a'"):
        env_backends.load_corpus(_write(tmp_path / "c.jsonl", [ok, ok]))


def test_corpus_layouts_wiki18_and_pyserini(tmp_path):
    # wiki-18 (Search-R1's corpus): {"id", "contents"}, contents = '"Title"\ntext'; pyserini's stored
    # documents carry title, text and contents (title and text are used); ids may be numbers
    wiki = _write(tmp_path / "wiki.jsonl", [{"id": "0", "contents": '"Aaron"\nAaron is a prophet in the Bible.'},
                                            {"id": 1, "contents": '"Abba (band)"\nAbba were a Swedish pop group.'}])
    assert env_backends.load_corpus(wiki) == [{"id": "0", "title": "Aaron", "text": "Aaron is a prophet in the Bible."},
                                              {"id": "1", "title": "Abba (band)",
                                               "text": "Abba were a Swedish pop group."}]
    pys = _write(tmp_path / "pys.jsonl", [{"id": "d7", "title": "Marnel", "text": "Marnel is a city.",
                                           "contents": "Marnel\nMarnel is a city."}])
    assert env_backends.load_corpus(pys) == [{"id": "d7", "title": "Marnel", "text": "Marnel is a city."}]
    r = env_backends.BM25Retriever(wiki, cache=False)   # the in-process retriever indexes it
    assert r.search(["Swedish pop group"], k=1)[0][0]["title"] == "Abba (band)"


def _verl_row(source, question, answers, split, index, agent=False):
    """A row as Search-R1's qa_search_*_merge.py writes it, or (agent) as verl-agent's preprocessing does."""
    prompt = [{"role": "user", "content": f"Answer the given question. ... Question: {question}\n"}]
    extra = {"split": split, "index": index}
    if agent:
        prompt = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": f"You are an expert agent ... Question: {question}"}]
        extra["question"] = question
    return {"data_source": ("searchR1_" if agent else "") + source, "prompt": prompt, "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers}}, "extra_info": extra}


def test_flashrag_folders_take_their_source_from_the_folder(tmp_path):
    for src, q in (("nq", "who wrote hamlet"), ("hotpotqa", "which city is older")):
        (tmp_path / src).mkdir()
        _write(tmp_path / src / "test.jsonl", [{"id": "test_0", "question": q, "golden_answers": ["x"],
                                                "metadata": {"answer_type": "span"}}])
    rows = env_backends.list_qa(str(tmp_path), "test")
    assert [(r["id"], r["data_source"], r["task_type"]) for r in rows] == [("hotpotqa:test_0", "hotpotqa", "multi"),
                                                                            ("nq:test_0", "nq", "single")]
    (tmp_path / "webqa").mkdir()
    _write(tmp_path / "webqa" / "test.jsonl", [{"id": "test_0", "question": "q", "golden_answers": ["x"]}])
    with pytest.raises(EnvDataError, match=r"webqa/test.jsonl:1 .* has data_source 'webqa'.*name the folder"):
        env_backends.list_qa(str(tmp_path), "test")


def test_verl_agent_rows_system_prompt_and_prefixed_sources(tmp_path):
    p = _write(tmp_path / "train.jsonl", [_verl_row("nq", "who sang x?", ["Abba"], "train", 0, agent=True),
                                          _verl_row("hotpotqa", "where is y?", ["Paris"], "train", 1, agent=True)])
    rows = env_backends.load_qa(p)
    assert [(r["id"], r["question"], r["data_source"], r["golden_answers"]) for r in rows] == [
        ("nq:train-0", "who sang x?", "nq", ["Abba"]), ("hotpotqa:train-1", "where is y?", "hotpotqa", ["Paris"])]


def _write_parquet(path: Path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def test_search_r1_parquet_pair_ids_unique_across_splits(tmp_path):
    # Search-R1's parquet files (nested prompt list, reward_model and extra_info structs); extra_info.index
    # restarts at 0 in each split, so the ids carry the split: nq:train-0 and nq:test-0 are two questions
    _write_parquet(tmp_path / "train.parquet", [_verl_row("nq", "who wrote a?", ["A"], "train", 0),
                                                _verl_row("hotpotqa", "where is b?", ["B"], "train", 1)])
    _write_parquet(tmp_path / "test.parquet", [_verl_row("nq", "who wrote c?", ["C"], "test", 0)])
    import pyarrow.parquet as pq
    assert pq.read_schema(str(tmp_path / "train.parquet")).field("reward_model").type.num_fields == 2   # a struct
    import train as T
    a = T.parse_args(["--env", "search", "--data_root", str(tmp_path), "--eval_split", "test"])
    data = envs.env_data(a, None)
    assert data.train == ["nq:train-0", "hotpotqa:train-1"] and data.eval == ["nq:test-0"]
    assert data.records["nq:test-0"]["question"] == "who wrote c?"     # not the train question nq:0 was before


def test_a_question_id_in_both_splits_is_refused(tmp_path):
    row = {"id": "q1", "question": "who?", "golden_answers": ["x"], "data_source": "nq"}
    _write(tmp_path / "train.jsonl", [row, {**row, "id": "q2"}])
    _write(tmp_path / "test.jsonl", [{**row, "question": "other?"}])
    import train as T
    a = T.parse_args(["--env", "search", "--data_root", str(tmp_path), "--eval_split", "test"])
    with pytest.raises(EnvDataError, match=r"1 task ids are in both --train_split train and --eval_split test .*nq:q1"):
        envs.env_data(a, None)


def test_shipped_set_sizes_and_layout(qa):
    assert sum(i.startswith("gen_") and ":train-" in i for i in qa) == 300
    assert sum(":test-" in i for i in qa) == 100
    types = [r["task_type"] for r in qa.values()]
    assert types.count("single") == types.count("multi") == 200       # half and half
    assert all(len(r["demo"]["queries"]) == (1 if r["task_type"] == "single" else 2) for r in qa.values())
    size = sum(os.path.getsize(DATA / f) for f in ("train.jsonl", "test.jsonl", "corpus.jsonl"))
    assert size < 1_000_000 and len(env_backends.load_corpus(CORPUS)) == 170   # 10 + 40 + 80 + 40 entities


# ---------------------------------------------------------------------------------------------
# BM25


def test_bm25_retrieves_the_gold_passage(bm25, qa):
    q = qa["gen_single:train-0000"]      # "Where was Sorhal Corcorix born?" → Ulgar
    assert q["question"] == "Where was Sorhal Corcorix born?" and q["golden_answers"] == ["Ulgar"]
    name_hits, question_hits, none_hits = bm25.search(["Sorhal Corcorix", q["question"], "zzzz qqqq"], k=3)
    # the person's passage names them twice: rank 1 for the name and for the whole question
    assert name_hits[0]["title"] == "Sorhal Corcorix" and "born in Ulgar" in name_hits[0]["text"]
    assert question_hits[0]["title"] == "Sorhal Corcorix"
    assert none_hits == []                                   # no query word in the corpus: no results
    assert bm25.search(["the of and"], k=3) == [[]]          # stopwords only: no results
    assert all(h["score"] > 0 for h in name_hits)
    assert [h["score"] for h in question_hits] == sorted((h["score"] for h in question_hits), reverse=True)
    assert len(bm25.search(["Sorhal"], k=1000)[0]) <= 170     # k beyond the corpus is clamped


def test_bm25_index_is_cached_by_content(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _write(corpus, [{"id": "1", "title": "Alpha", "text": "red fox"},
                    {"id": "2", "title": "Beta", "text": "blue whale"}])
    first = env_backends.BM25Retriever(str(corpus))
    assert not first.from_cache and os.path.isdir(first.cache_dir)
    second = env_backends.BM25Retriever(str(corpus))
    assert second.from_cache and second.cache_dir == first.cache_dir
    hits = second.search(["whale"], 2)
    assert hits == first.search(["whale"], 2) and [h["id"] for h in hits[0]] == ["2"]   # only Beta has "whale"
    _write(corpus, [{"id": "1", "title": "Alpha", "text": "red whale"}])   # new content: a new index
    third = env_backends.BM25Retriever(str(corpus))
    assert not third.from_cache and third.cache_dir != first.cache_dir
    assert [h["id"] for h in third.search(["whale"], 2)[0]] == ["1"]


# ---------------------------------------------------------------------------------------------
# The env


def test_env_scripted_multi_hop_episode(bm25, qa):
    q = qa["gen_multi:test-0001"]   # In which country is the headquarters of Rhobeltek? → Marnel → Gartis
    env = envs.SearchEnv(bm25, qa, max_turns=4, top_k=3)
    obs, info = env.reset(q["id"])
    assert obs == "" and info["task"] == q["question"] and info["task_type"] == "multi" and not info["won"]
    obs, r, done, info = env.step("<think> hop 1 </think> <search> Rhobeltek </search>")
    assert (r, done, info["invalid_action"], info["searches"]) == (0.0, False, False, 1)
    assert obs.startswith('<information> Doc 1(Title: "Rhobeltek")') and "based in Marnel" in obs
    # a company is named only in its own passage; the others score 0 and are not returned
    assert obs.count("Doc ") == 1
    obs, r, done, info = env.step("<search> Marnel </search>")
    assert "Marnel is a city in the country of Gartis" in obs
    obs, r, done, info = env.step("<answer> gartis. </answer>")        # EM after normalisation
    assert (obs, r, done, info["won"], info["steps"], info["answer"]) == ("", 1.0, True, True, 3, "gartis.")
    with pytest.raises(RuntimeError):
        env.step("<answer> Gartis </answer>")                          # the episode is over


def test_env_wrong_answer_invalid_turns_and_max_turns(bm25, qa):
    env = envs.SearchEnv(bm25, qa, max_turns=4)
    env.reset("gen_multi:test-0001")
    _, r, done, info = env.step("<answer> Marnel </answer>")           # answer before any search: a normal turn
    assert (r, done, info["won"], info["invalid_action"], info["searches"]) == (0.0, True, False, False, 0)
    env.reset("gen_multi:test-0001")
    _, r, done, info = env.step("<answer> Gartis </answer>")           # a right guess without searching still scores
    assert (r, info["won"]) == (1.0, True)
    env.reset("gen_multi:test-0001")
    outs = [env.step(a) for a in ["<search> Rhobeltek", "<search> a </search><search> b </search>",
                                  "<search> Rhobeltek </search>", "<search> Marnel </search>"]]
    assert [o[0] == envs.INVALID_SEARCH_OBS for o in outs] == [True, True, False, False]
    assert [o[3]["invalid_action"] for o in outs] == [True, True, False, False]
    assert [o[2] for o in outs] == [False, False, False, True]          # the 4th turn ends it: max turns
    assert outs[-1][3]["truncated"] and outs[-1][1] == 0.0 and not outs[-1][3]["won"]


def test_env_non_ascii_query_is_a_normal_search(bm25, qa):
    env = envs.SearchEnv(bm25, qa)
    env.reset("gen_multi:test-0001")
    obs, _, done, info = env.step("<search> Zürich Rhobeltek </search>")
    assert not info["invalid_action"] and "Rhobeltek" in obs and not done


class _SlowRetriever:
    """A retriever that hangs (longer than the pool's timeout)."""
    def __init__(self, inner, sleep):
        self.inner, self.sleep = inner, sleep

    def search(self, queries, k=3):
        time.sleep(self.sleep)
        return self.inner.search(queries, k)


class _BrokenRetriever:
    def search(self, queries, k=3):
        raise RetrieverError("index on fire")


def test_pool_lockstep_and_none_for_finished(bm25, qa):
    with envs.SearchPool(bm25, qa, max_turns=4) as pool:
        starts = pool.reset(["gen_multi:test-0001", "gen_multi:test-0001", "nope"])
        assert [s[1]["error"] is None for s in starts] == [True, True, False]   # unknown id: that episode fails
        assert pool.active == [True, True, False] and pool.stats["errors"] == 1
        out = pool.step(["<answer> Gartis </answer>", "<search> Rhobeltek </search>", "x"])
        assert out[0][1:3] == (1.0, True) and out[1][2] is False and out[2] is None
        out = pool.step(["ignored", "<answer> Narnia </answer>", "x"])
        assert out[0] is None and out[1][1:3] == (0.0, True) and pool.stats["searches"] == 1
    with pytest.raises(RuntimeError, match="closed"):
        pool.reset(["gen_multi:test-0001"])


def test_pool_retriever_timeout_fails_the_searching_episodes_without_hanging(bm25, qa):
    pool = envs.SearchPool(_SlowRetriever(bm25, 5.0), qa, timeout=0.3)
    pool.reset(["gen_multi:test-0001"] * 3)
    t0 = time.monotonic()
    out = pool.step(["<search> Rhobeltek </search>", "<answer> Gartis </answer>", "<search> Marnel </search>"])
    assert time.monotonic() - t0 < 2.0                         # bounded by the 0.3 s timeout, not the 5 s hang
    for i in (0, 2):                                           # the searching episodes failed ...
        obs, r, done, info = out[i]
        assert done and r == 0.0 and not info["won"] and "RetrieverTimeout" in info["error"]
    assert out[1][1:3] == (1.0, True) and out[1][3]["error"] is None   # ... the answering one did not
    assert pool.stats["timeouts"] == 1 and pool.stats["errors"] == 2 and pool.active == [False] * 3
    pool = envs.SearchPool(_BrokenRetriever(), qa)
    pool.reset(["gen_multi:test-0001"])
    (_, _, done, info), = pool.step(["<search> x </search>"])
    assert done and "index on fire" in info["error"] and pool.stats["retriever_errors"] == 1


# ---------------------------------------------------------------------------------------------
# Rollout wiring (the pool supplies prompt, parser, task prefix) with a scripted engine


class _ScriptedEngine:
    """Answers call c with script[c][j] for the j-th prompt of that call (no model); a prompt is one token a word."""
    max_prompt_tokens = 10_000

    def __init__(self, script):
        self.script, self.calls, self.prompts = script, 0, []

    def prompt_len(self, prompt):
        return len(prompt.split())

    def generate(self, prompts, temperature=None, greedy=False, allowed_actions=None, **kw):
        texts = self.script[self.calls]
        self.calls += 1
        self.prompts.append(prompts)
        assert len(texts) == len(prompts)
        return [Generation(t, [1, 2], [-0.1, -0.2], [3]) for t in texts]


def test_run_episodes_drives_the_search_pool(bm25, qa):
    eng = _ScriptedEngine([
        ["<search> Rhobeltek </search>", "<think> hm </think>"],      # ep 1: no tag → invalid turn
        ["<search> Marnel </search>", "<answer> Narnia </answer>"],
        ["<answer> Gartis </answer>"],
    ])
    with envs.SearchPool(bm25, qa) as pool:
        eps = run_episodes(eng, pool, [{"id": "gen_multi:test-0001"}], 2, skills={0: "search twice"},
                           group_offset=5)
    e0, e1 = eps
    assert (e0.reward, e0.won, len(e0.turns), e0.task_type, e0.group_id) == (1.0, True, 3, "multi", 5)
    # ep 1: turn 1 had no tag (invalid, "" sent to the env), turn 2 answered wrongly
    assert (e1.reward, e1.won, [t.invalid for t in e1.turns]) == (0.0, False, [True, False])
    assert e1.steps == [("", ""), (envs.INVALID_SEARCH_OBS, "<answer> Narnia </answer>")]
    assert e0.steps[0][1] == "<search> Rhobeltek </search>"          # the canonical action is recorded
    first = eng.prompts[0][0].splitlines()
    assert first[1] == "Question: In which country is the headquarters of Rhobeltek?"
    assert first[2] == "Skill for this task: [search twice]"
    assert "Turn 2: <search> Marnel </search>" in eng.prompts[2][0] and "Gartis" in eng.prompts[2][0]


class _SeedRecorder(_ScriptedEngine):
    """Searches once, then answers; records each request's seed."""

    def __init__(self):
        super().__init__([])
        self.seeds = []

    def generate(self, prompts, temperature=None, greedy=False, allowed_actions=None, seeds=None, **kw):
        self.seeds.append(seeds)
        turn = len(self.seeds) - 1
        return [Generation("<search> Rhobeltek </search>" if turn == 0 else "<answer> x </answer>", [1], [-0.1], [3])
                for _ in prompts]


def test_evaluation_requests_carry_the_same_seeds_in_every_evaluation(bm25, qa):
    """Common random numbers on an engine that samples each request alone (vLLM): the seed of a request
    depends on the run seed, the task, the copy and the turn only, not on the batch or the rank."""
    import train as T
    from rollout import evaluate, request_seed
    args = T.parse_args(["--env", "search", "--eval_repeats", "2"])
    games = ["gen_multi:test-0001", "gen_single:test-0000"]
    seen = []
    with envs.SearchPool(bm25, qa) as pool:
        for order in (games, games[::-1]):
            eng = _SeedRecorder()
            evaluate(eng, pool, order, repeats=args.eval_repeats, seed=args.seed, history_len=args.history_len,
                     temperature=args.eval_temperature)
            seen.append(eng.seeds)
    base = 1_000_003 * (args.seed + 1)
    want = [[request_seed(base, g, c, 0) for g in games for c in (0, 1)],
            [request_seed(base, g, c, 1) for g in games for c in (0, 1)]]
    assert seen[0] == want
    assert sorted(map(sorted, seen[1])) == sorted(map(sorted, want))     # other batch order, the same seeds
    assert len({s for turn in want for s in turn}) == 8                 # every (task, copy, turn) its own
    assert request_seed(base + 1, games[0], 0, 0) != want[0][0]          # another run seed, other numbers
    eng = _SeedRecorder()
    with envs.SearchPool(bm25, qa) as pool:                              # training rollouts: no seeds
        run_episodes(eng, pool, [{"id": games[0]}], 2)
    assert eng.seeds == [None, None]


def test_hf_engine_stop_texts(tmp_path):
    from harness import tiny
    import train as T
    from rollout import HFEngine
    tok = tiny.train_tiny_tokenizer(["a b <search> c </search> <answer> d </answer> user assistant"],
                                    tiny.SEARCH_SPECIALS)
    model = tiny.tiny_model(len(tok), T.Args(tiny_hidden=32)).eval()
    eng = HFEngine(model, tok, max_new_tokens=4, stop_texts=list(envs.SearchPool.stop_texts))
    assert eng.stop_ids == [tok.convert_tokens_to_ids("</search>"), tok.convert_tokens_to_ids("</answer>")]
    assert HFEngine(model, tok).stop_texts == ["</action>"]          # the ALFWorld default is unchanged
    assert envs.EnvPool.stop_texts == ("</action>",) and envs.EnvPool.task_key == "gamefile"


# ---------------------------------------------------------------------------------------------
# HTTP client against a real loopback server


@pytest.fixture()
def server(bm25):
    started = []

    def start(delay=0.0):
        srv = retrieval_server.make_server(bm25, "127.0.0.1", 0, topk=3, delay=delay)
        retrieval_server.serve_in_thread(srv)
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def test_http_client_success_matches_in_process_bm25(server, bm25):
    url = server()
    client = env_backends.HTTPRetriever(url, timeout=5)
    assert client.url == url + "/retrieve"
    got = client.search(["Sorhal Corcorix", "zzzz qqqq", "Marnel"], 3)
    want = bm25.search(["Sorhal Corcorix", "zzzz qqqq", "Marnel"], 3)
    assert [[h["id"] for h in row] for row in got] == [[h["id"] for h in row] for row in want]
    assert got[0][0]["title"] == "Sorhal Corcorix" and got[0][0]["text"] == want[0][0]["text"]  # contents split back
    assert got[0][0]["score"] == pytest.approx(want[0][0]["score"], rel=1e-6) and got[1] == []
    # the raw protocol: bare documents without scores, "contents" = '"Title"\ntext'; 400 on a bad request
    req = urllib.request.Request(url + "/retrieve", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"queries": ["Marnel"], "topk": 1}).encode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    doc = json.loads(opener.open(req, timeout=5).read())["result"][0][0]
    assert set(doc) == {"id", "contents"} and doc["contents"].startswith('"Marnel"\nMarnel is a city')
    bad = urllib.request.Request(url + "/retrieve", method="POST", data=json.dumps({"queries": "x"}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        opener.open(bad, timeout=5)
    assert e.value.code == 400
    # and the client under the env pool: one HTTP batch per lock-step
    with envs.SearchPool(client, {"q": {"id": "q", "question": "Where?", "golden_answers": ["Gartis"],
                                        "task_type": "multi"}}) as pool:
        pool.reset(["q", "q"])
        out = pool.step(["<search> Rhobeltek </search>", "<search> Marnel </search>"])
        assert '(Title: "Rhobeltek")' in out[0][0] and '(Title: "Marnel")' in out[1][0] and pool.stats["errors"] == 0


def test_http_client_timeout_on_a_slow_server(server):
    url = server(delay=1.5)
    client = env_backends.HTTPRetriever(url, timeout=0.2, retries=1, backoff=0.05)
    t0 = time.monotonic()
    with pytest.raises(RetrieverTimeout, match=r"127\.0\.0\.1.*failed after 2 tries"):
        client.search(["Marnel"], 3)
    assert time.monotonic() - t0 < 1.2                  # 2 tries x 0.2 s + 0.05 s backoff, never the 1.5 s delay


def test_http_client_server_down_is_a_clear_error():
    with socket.socket() as s:                          # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = env_backends.HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout=1, retries=2, backoff=0.2)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match=rf"127\.0\.0\.1:{port}/retrieve failed after 3 tries.*running") as e:
        client.search(["x"], 3)
    assert not isinstance(e.value, RetrieverTimeout)     # refused, not slow
    assert 0.6 <= time.monotonic() - t0 < 3.0            # refusals are instant; backoff 0.2 + 0.4 s between tries


# ---------------------------------------------------------------------------------------------
# Generator


def test_generator_is_deterministic_and_matches_the_shipped_set(tmp_path):
    qa_gen.generate(str(tmp_path / "a"))
    for f in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / f).read_bytes() == (DATA / f).read_bytes(), f
    qa_gen.generate(str(tmp_path / "b"), seed=1, n_train=20, n_test=10)
    assert (tmp_path / "b" / "corpus.jsonl").read_bytes() != (DATA / "corpus.jsonl").read_bytes()


def test_generator_verification_catches_broken_demos(tmp_path, bm25, qa):
    env = envs.SearchEnv(bm25, max_turns=4)
    good = qa["gen_multi:test-0001"]
    assert qa_gen.verify(good, env) is None
    wrong_answer = dict(good, demo={"queries": ["Rhobeltek", "Marnel"], "answer": "Narnia"})
    assert "does not show 'Narnia'" in qa_gen.verify(wrong_answer, env)
    wrong_hop = dict(good, demo={"queries": ["Qqqq", "Marnel"], "answer": "Gartis"})   # no passage titled Qqqq
    assert "does not bring the passage of 'Qqqq' into the top k" in qa_gen.verify(wrong_hop, env)
    shutil.copytree(DATA, tmp_path / "d", ignore=shutil.ignore_patterns(".bm25_*"))
    rows = [json.loads(l) for l in (tmp_path / "d" / "test.jsonl").read_text().splitlines()]
    rows[3]["golden_answers"] = ["Narnia"]             # the demo's answer no longer earns the reward
    _write(tmp_path / "d" / "test.jsonl", rows)
    bad = qa_gen.verify_dir(str(tmp_path / "d"))
    assert len(bad) == 1 and bad[0].startswith(f"{rows[3]['data_source']}:test-0003")


# ---------------------------------------------------------------------------------------------
# train.py --env search, end to end (tiny)


def test_search_defaults_apply_unless_given():
    from harness import config
    import train as T
    a = T.parse_args(["--env", "search"])
    assert (a.data_root, a.eval_split, a.max_turns, a.history_len, a.p_fmt, a.r_win, a.c_kl, a.constrained) == \
        ("data/search_qa", "test", 4, 4, 0.01, 1.0, 0.001, False)
    a = T.parse_args(["--env", "search", "--max_turns", "3", "--p_fmt=0.5", "--c_kl", "0.001", "--history_l", "2"])
    assert (a.max_turns, a.p_fmt, a.history_len, a.r_win) == (3, 0.5, 2, 1.0)   # given (even abbreviated) wins
    assert T.parse_args([]).max_turns == config.TINY["max_turns"]                # ALFWorld untouched
    assert T.parse_args(["--model", "org/real"]).max_turns == T.Args().max_turns
    with pytest.raises(SystemExit, match="--env"):
        T.parse_args(["--env", "webshop"])


def test_train_env_search_end_to_end_rsipo(tmp_path):
    import train as T
    argv = ["--env", "search", "--algo", "rsipo", "--sft_steps", "8", "--sft_batch", "8", "--steps", "2",
            "--tasks_per_step", "2", "--group_size", "2", "--eval_games", "4", "--eval_repeats", "1",
            "--mini_batch", "8", "--micro_batch", "4", "--tiny_hidden", "32", "--max_new_tokens", "12",
            "--skill_max_tokens", "12", "--drop_zero_adv", "false", "--save_every", "2",
            "--out_dir", str(tmp_path), "--run_name", "s"]
    summary = T.main(argv)
    run = tmp_path / "s"
    assert {"eval/success_at_start", "eval/success", "eval/success_single", "eval/success_multi",
            "eval/success_gen_single", "eval/success_gen_multi", "eval_at_start/success_source_mean"} <= set(summary)
    assert summary["eval/success_source_mean"] == pytest.approx(
        (summary["eval/success_gen_single"] + summary["eval/success_gen_multi"]) / 2)
    assert summary["config"]["env"] == "search" and summary["config"]["r_win"] == 1.0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/success" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "train/reward", "kl/k3"))
        assert "skill/written_frac" in r and "trust/mean" in r and r["train/env_errors"] == 0
    tok = json.loads((run / "tokenizer" / "tokenizer.json").read_text())
    added = {t["content"] for t in tok["added_tokens"]}
    assert {"<search>", "</search>", "<answer>", "</answer>"} <= added
    from test_train import _changed_from_warm_start, _state
    assert _changed_from_warm_start(run, _state(run)["model"])   # RL moved weights away from the reference


FAKE_JAX = {
    "jax/__init__.py": "import os, json\nSEEN = os.environ.get('JAX_PLATFORMS')\n"
                       "open(os.environ['FAKE_JAX_LOG'], 'a').write(json.dumps({'import': SEEN}) + '\\n')\n",
    "jax/lax.py": "import os, json, numpy as np\n"
                  "def top_k(x, k):\n"
                  "    open(os.environ['FAKE_JAX_LOG'], 'a').write(json.dumps({'top_k': int(np.size(x))}) + '\\n')\n"
                  "    x = np.asarray(x); i = np.argsort(-x)[:k]; return x[i], i\n"}


def test_bm25_keeps_an_installed_jax_off_the_gpu(tmp_path):
    """bm25s runs a JAX top-k when it is imported, if JAX is installed; on a GPU machine JAX's first use took
    105 GiB of an H200 and the trainer then ran out of memory. The retriever imports bm25s with JAX on the CPU
    and retrieves with numpy. A stand-in `jax` records what it sees."""
    for rel, text in FAKE_JAX.items():
        (tmp_path / "fake" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / rel).write_text(text)
    log = tmp_path / "jax.log"
    code = ("import sys; sys.path.insert(0, %r); from infra import env_backends\n"
            "r = env_backends.BM25Retriever(%r, cache=False)\n"
            "print(len(r.search(['Sorhal Corcorix', 'mayor of Eskqui'], k=2)))") % (
        str(ROOT), str(ROOT / "data/search_qa/corpus.jsonl"))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(PYTHONPATH=str(tmp_path / "fake"), FAKE_JAX_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]
    seen = [json.loads(x) for x in log.read_text().splitlines()]
    assert seen[0] == {"import": "cpu"}                       # bm25s did import the stand-in, with JAX on the CPU
    assert [s for s in seen if "top_k" in s] == [{"top_k": 5}]   # only bm25s's own import-time probe, no retrieval


class _AlwaysGartis(_ScriptedEngine):
    def __init__(self):
        super().__init__([])

    def generate(self, prompts, **kw):
        return [Generation("<answer> Gartis </answer>", [1], [-0.1], [3]) for _ in prompts]


def test_evaluation_reports_exact_match_per_data_source_and_their_unweighted_mean(bm25, qa):
    # Search-R1's protocol: EM per data set, then the plain mean over data sets. One gen_multi question
    # whose gold is Gartis (won) and two gen_single ones (lost): pooled 1/3, per source 1.0 and 0.0, mean 0.5
    from rollout import evaluate
    games = ["gen_multi:test-0001", "gen_single:test-0000", "gen_single:test-0002"]
    with envs.SearchPool(bm25, qa) as pool:
        out, _ = evaluate(_AlwaysGartis(), pool, games, repeats=1, seed=0, history_len=4, temperature=0.0,
                          source_of={g: qa[g]["data_source"] for g in games})
    assert out["eval/success"] == pytest.approx(1 / 3)
    assert out["eval/success_gen_multi"] == 1.0 and out["eval/success_gen_single"] == 0.0
    assert out["eval/success_source_mean"] == 0.5


class _SlowOn(_SlowRetriever):
    """Hangs on any request that holds a query with `word` in it."""
    def __init__(self, inner, sleep, word):
        super().__init__(inner, sleep)
        self.word, self.requests = word, []

    def search(self, queries, k=3):
        self.requests.append(list(queries))
        if any(self.word in q for q in queries):
            time.sleep(self.sleep)
        return self.inner.search(queries, k)


@pytest.mark.parametrize("batch, failed", [(1, [1]), (2, [0, 1])])
def test_retrieval_goes_in_batches_and_a_slow_batch_fails_only_its_episodes(bm25, qa, batch, failed):
    # three searching episodes, the second query hangs: requests of `batch` queries, each with 0.3 s per
    # query; only the episodes of the request that held it fail (batch 1: that one; batch 2: the first two)
    slow = _SlowOn(bm25, 5.0, "Marnel")
    pool = envs.SearchPool(slow, qa, timeout=0.3, batch=batch)
    pool.reset(["gen_multi:test-0001"] * 3)
    t0 = time.monotonic()
    out = pool.step(["<search> Rhobeltek </search>", "<search> Marnel </search>", "<search> Torix </search>"])
    assert time.monotonic() - t0 < 3.0
    assert slow.requests == ([["Rhobeltek"], ["Marnel"], ["Torix"]]
                             if batch == 1 else [["Rhobeltek", "Marnel"], ["Torix"]])
    for i in range(3):
        obs, r, done, info = out[i]
        if i in failed:
            assert done and "RetrieverTimeout" in info["error"]
        else:
            assert not done and info["error"] is None and obs.startswith("<information> Doc 1(Title:")
    assert pool.stats["timeouts"] == 1 and pool.stats["errors"] == len(failed) and pool.stats["searches"] == 3


def _real_format_dir(root: Path) -> Path:
    """The shipped questions as Search-R1's parquet pair (verl rows, sources renamed nq / hotpotqa, no ids:
    extra_info.index restarts in each split) and the shipped passages as a wiki-18 corpus."""
    root.mkdir(parents=True, exist_ok=True)
    rename = {"gen_single": "nq", "gen_multi": "hotpotqa"}
    for split in ("train", "test"):
        rows = [_verl_row(rename[r["data_source"]], r["question"], r["golden_answers"], split, i)
                for i, r in enumerate(env_backends.list_qa(str(DATA), split))]
        _write_parquet(root / f"{split}.parquet", rows)
    _write(root / "corpus.jsonl", [{"id": str(i), "contents": f'"{p["title"]}"\n{p["text"]}'}
                                   for i, p in enumerate(env_backends.load_corpus(CORPUS))])
    return root


@pytest.mark.parametrize("via", ["bm25", "server"])
def test_train_on_search_r1_parquet_and_a_wiki18_corpus(tmp_path, via):
    # python train.py --env search --data_root D on Search-R1's formats, with the in-process BM25 over D's
    # wiki-18 corpus or with the project's retrieval server serving it; the summary holds EM per data source
    import train as T
    d = _real_format_dir(tmp_path / "d")
    argv = ["--env", "search", "--data_root", str(d), "--algo", "grpo", "--sft_steps", "0", "--steps", "1",
            "--tasks_per_step", "2", "--group_size", "2", "--eval_games", "6", "--eval_repeats", "1",
            "--tiny_hidden", "32", "--max_new_tokens", "12", "--out_dir", str(tmp_path), "--run_name", via]
    srv = None
    if via == "server":
        srv = retrieval_server.make_server(env_backends.BM25Retriever(str(d / "corpus.jsonl"), cache=False),
                                           "127.0.0.1", 0, topk=3)
        retrieval_server.serve_in_thread(srv)
        argv += ["--retriever_url", f"http://127.0.0.1:{srv.server_address[1]}"]
    try:
        s = T.main(argv)
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    assert {"eval/success_nq", "eval/success_hotpotqa", "eval/success_source_mean"} <= set(s)
    assert s["eval/success_source_mean"] == pytest.approx((s["eval/success_nq"] + s["eval/success_hotpotqa"]) / 2)
    rows = [json.loads(x) for x in (tmp_path / via / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "train/success" in r]
    assert len(step) == 1 and step[0]["train/env_errors"] == 0    # every search of the step was answered

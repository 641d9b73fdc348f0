"""Generate the project's small search-QA set: a seeded fictional world, its passages, and single-
and two-hop questions with engine-verified gold search trajectories (the ALFWorld analogue is
scripts/alfworld_gen.py and its walkthroughs).

Contract
--------
* World (seeded): countries, cities, people and companies with made-up names, so that no answer can
  be known without searching. A country has a capital; a city its country and mayor; a person a
  birthplace, birth year and occupation; a company a founder, headquarters city, founding year and
  product. One passage per entity (`corpus.jsonl`: id, title, text).
* Questions (Search-R1 layout, `train.jsonl` / `test.jsonl`): `id`, `question`, `golden_answers`,
  `data_source` (`gen_single` → task type single, `gen_multi` → multi, see env_backends.SEARCH_TASK_TYPES)
  and `demo` = {"queries": [...], "answer": ...}: the gold trajectory (one query per hop: the
  entity's name; then the answer).
* Verification: every demonstration is played through `envs.SearchEnv` with the BM25 retriever
  (top-k 3) over the written corpus: each query must bring the passage it needs into the top k,
  the bridge entity of a two-hop question must be readable in the first result block, and the
  final answer must earn the exact-match reward. Candidates that fail are dropped (the count is
  printed); `--verify` re-checks shipped files and exits 1 on any failure.

Choices, all **[ours]**:
1. Half single-hop, half two-hop questions; (entity, relation) pairs are unique over both splits,
   drawn in a seeded order and split train/test after shuffling.
2. A person's passage names them twice, so that a name query ranks their own passage above the
   passages that merely mention them (a founder's company, a mayor's city).
3. Output is byte-identical for the same arguments (sorted keys, fixed order; a test checks the
   shipped files against a fresh generation).

Run:    python scripts/qa_gen.py --out data/search_qa    (defaults: seed 0, 300 train, 100 test)
Check:  python scripts/qa_gen.py --out data/search_qa --verify
Test:   python -m pytest -q tests/test_search.py -k gen
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

SYLLABLES = ["ka", "lo", "ven", "mar", "tis", "dra", "bel", "sor", "qui", "nel", "vash", "tor", "mi",
             "zan", "rho", "pel", "gar", "lun", "esk", "fa", "bro", "yel", "cor", "dun", "hal", "ix",
             "sev", "ul", "wen", "ost"]
OCCUPATIONS = ["chemist", "painter", "architect", "pilot", "poet", "judge", "sculptor", "engineer",
               "astronomer", "composer", "surgeon", "botanist"]
PRODUCTS = ["bicycles", "lamps", "tea", "clocks", "kites", "glass", "rope", "boots", "maps", "soap",
            "violins", "paper"]
SUFFIXES = ["corp", "works", "tek", "ford", "line", "wick"]

SINGLE = [  # (entity kind, relation, question template)
    ("person", "birthplace", "Where was {e} born?"),
    ("person", "year", "In what year was {e} born?"),
    ("person", "occupation", "What was the occupation of {e}?"),
    ("city", "country", "In which country is {e}?"),
    ("city", "mayor", "Who is the mayor of {e}?"),
    ("company", "founder", "Who founded {e}?"),
    ("company", "product", "What does {e} make?"),
    ("company", "city", "In which city is {e} based?"),
    ("country", "capital", "What is the capital of {e}?"),
]
MULTI = [  # (entity kind, first relation → bridge entity, second relation, question template)
    ("company", "founder", "birthplace", "Where was the founder of {e} born?"),
    ("company", "founder", "occupation", "What was the occupation of the founder of {e}?"),
    ("company", "city", "country", "In which country is the headquarters of {e}?"),
    ("city", "mayor", "year", "In what year was the mayor of {e} born?"),
    ("person", "birthplace", "country", "In which country was {e} born?"),
]


def _names(rng: random.Random, n: int, parts: tuple[int, int], used: set, suffix=None) -> list[str]:
    out = []
    while len(out) < n:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*parts)))
        if suffix:
            word += rng.choice(suffix)
        word = word.capitalize()
        if word not in used and len(word) >= 4:
            used.add(word)
            out.append(word)
    return out


def make_world(seed: int, n_countries=10, n_cities=40, n_people=80, n_companies=40) -> dict:
    """Entities and their attributes; people found at most one company and run at most one city."""
    rng = random.Random(seed)
    used: set = set()
    countries = _names(rng, n_countries, (2, 3), used)
    cities = _names(rng, n_cities, (2, 2), used)
    firsts, lasts = _names(rng, n_people, (2, 2), used), _names(rng, n_people, (2, 3), used)
    people = [f"{a} {b}" for a, b in zip(firsts, lasts)]
    companies = _names(rng, n_companies, (1, 2), used, SUFFIXES)
    world: dict = {"country": {}, "city": {}, "person": {}, "company": {}}
    city_country = {c: countries[i % n_countries] for i, c in enumerate(cities)}  # every country has cities
    for c in countries:
        world["country"][c] = {"capital": rng.choice([x for x in cities if city_country[x] == c])}
    for p in people:
        world["person"][p] = {"birthplace": rng.choice(cities), "year": str(rng.randint(1890, 1999)),
                              "occupation": rng.choice(OCCUPATIONS)}
    roles = rng.sample(people, n_cities + n_companies)  # distinct mayors and founders
    for i, c in enumerate(cities):
        world["city"][c] = {"country": city_country[c], "mayor": roles[i]}
    for i, c in enumerate(companies):
        world["company"][c] = {"founder": roles[n_cities + i], "city": rng.choice(cities),
                               "year": str(rng.randint(1850, 2015)), "product": rng.choice(PRODUCTS)}
    return world


def passages(world: dict) -> list[dict]:
    out = []
    for c, a in world["country"].items():
        out.append((c, f"{c} is a country. Its capital city is {a['capital']}."))
    for c, a in world["city"].items():
        out.append((c, f"{c} is a city in the country of {a['country']}. The mayor of {c} is {a['mayor']}."))
    for p, a in world["person"].items():
        out.append((p, f"{p} was a {a['occupation']}. {p} was born in {a['birthplace']} in {a['year']}."))
    for c, a in world["company"].items():
        out.append((c, f"{c} is a company that makes {a['product']}. It was founded in {a['year']} by "
                       f"{a['founder']} and is based in {a['city']}."))
    return [{"id": f"p{i:04d}", "title": t, "text": x} for i, (t, x) in enumerate(out)]


def candidates(world: dict, seed: int) -> list[dict]:
    """All (entity, relation) questions, shuffled with the seed, singles and multis interleaved."""
    rng = random.Random(seed + 1)
    single, multi = [], []
    for kind, rel, tpl in SINGLE:
        for e, a in world[kind].items():
            single.append({"question": tpl.format(e=e), "golden_answers": [a[rel]], "data_source": "gen_single",
                           "demo": {"queries": [e], "answer": a[rel]}})
    for kind, rel1, rel2, tpl in MULTI:
        for e, a in world[kind].items():
            bridge = a[rel1]
            bridge_kind = {"founder": "person", "mayor": "person", "city": "city", "birthplace": "city"}[rel1]
            ans = world[bridge_kind][bridge][rel2]
            multi.append({"question": tpl.format(e=e), "golden_answers": [ans], "data_source": "gen_multi",
                          "demo": {"queries": [e, bridge], "answer": ans}})
    rng.shuffle(single)
    rng.shuffle(multi)
    return [q for pair in zip(single, multi) for q in pair]


def verify(q: dict, env) -> str | None:
    """Play q's demonstration in the env; None if it retrieves what it needs and wins, else why.
    Each query is the name (= passage title) of the entity whose passage it needs."""
    env.reset(q)
    needs = q["demo"]["queries"]
    for j, need in enumerate(needs):
        query = need
        obs, _, done, info = env.step(f"<think> </think> <search> {query} </search>")
        if done or info["invalid_action"] or info["error"]:
            return f"search {query!r} ended the episode ({info['error']})"
        if f'(Title: "{need}")' not in obs:
            return f"search {query!r} does not bring the passage of {need!r} into the top k"
        nxt = needs[j + 1] if j + 1 < len(needs) else q["demo"]["answer"]
        if nxt not in obs:
            return f"the result of {query!r} does not show {nxt!r}"
    _, reward, done, info = env.step(f"<think> </think> <answer> {q['demo']['answer']} </answer>")
    if not (done and info["won"] and reward == 1.0):
        return f"the answer {q['demo']['answer']!r} was not rewarded"
    return None


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def generate(out: str, seed: int = 0, n_train: int = 300, n_test: int = 100, top_k: int = 3) -> dict:
    from infra.env_backends import SEARCH_TASK_TYPES, BM25Retriever
    from envs import SearchEnv
    os.makedirs(out, exist_ok=True)
    world = make_world(seed)
    corpus = passages(world)
    _write_jsonl(os.path.join(out, "corpus.jsonl"), corpus)
    env = SearchEnv(BM25Retriever(os.path.join(out, "corpus.jsonl")), top_k=top_k, max_turns=4)
    kept, dropped = [], 0
    for q in candidates(world, seed):
        if len(kept) == n_train + n_test:
            break
        rec = dict(q, id="", task_type=SEARCH_TASK_TYPES[q["data_source"]])
        if verify(rec, env) is None:
            kept.append(q)
        else:
            dropped += 1
    if len(kept) < n_train + n_test:
        raise SystemExit(f"only {len(kept)} verified questions; ask for fewer than {n_train} + {n_test}")
    for split, part in (("train", kept[:n_train]), ("test", kept[n_train:])):
        _write_jsonl(os.path.join(out, f"{split}.jsonl"),
                     [dict(r, id=f"{split}-{i:04d}") for i, r in enumerate(part)])
    return {"passages": len(corpus), "train": n_train, "test": n_test, "dropped": dropped}


def verify_dir(out: str, top_k: int = 3) -> list[str]:
    """Re-play every shipped demonstration; returns the failures (empty: all good)."""
    from infra.env_backends import BM25Retriever, list_qa
    from envs import SearchEnv
    env = SearchEnv(BM25Retriever(os.path.join(out, "corpus.jsonl")), top_k=top_k, max_turns=4)
    bad = []
    for split in ("train", "test"):
        for q in list_qa(out, split):
            why = verify(q, env)
            if why:
                bad.append(f"{q['id']}: {why}")
    return bad


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/search_qa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n_train", type=int, default=300)
    p.add_argument("--n_test", type=int, default=100)
    p.add_argument("--verify", action="store_true", help="only re-check the files in --out")
    a = p.parse_args(argv)
    if a.verify:
        bad = verify_dir(a.out)
        print("\n".join(bad) if bad else f"all demonstrations in {a.out} verified")
        sys.exit(1 if bad else 0)
    print(generate(a.out, a.seed, a.n_train, a.n_test))


if __name__ == "__main__":
    main()

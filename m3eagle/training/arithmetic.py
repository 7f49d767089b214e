"""Seeded generator of grade-school arithmetic word problems with worked step-by-step solutions.

Each problem is a short story about one quantity that changes through 1-4 operations (buying groups of
items, giving some away, doubling, sharing equally, ...), then a question. The solution states one
equation per step and ends with a GSM8K-style answer line:

    Question: Ava has 12 marbles. She buys 3 bags with 5 marbles in each bag. ...
    Answer: Ava buys 3 * 5 = 15 marbles.
    Now she has 12 + 15 = 27 marbles.
    ...
    #### 20

Every intermediate value stays a non-negative integer (division only when it is exact), so the answer
is checkable by exact match. The generator is a pure function of its seed: the training corpus and the
held-out evaluation set use different seeds, and the evaluation set drops any question that the
training set also holds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NAMES = ["Ava", "Ben", "Chloe", "Daniel", "Emma", "Felix", "Grace", "Hugo", "Isla", "Jack", "Kara", "Liam",
         "Maya", "Noah", "Olivia", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wes", "Yuki",
         "Zane", "Nina", "Omar", "Lena", "Ravi", "Sofia"]
# (item, container, verb for acquiring them)
ITEMS = [("apples", "bags", "picks"), ("marbles", "jars", "finds"), ("stickers", "packs", "buys"),
         ("cookies", "boxes", "bakes"), ("pencils", "boxes", "buys"), ("stamps", "albums", "collects"),
         ("books", "shelves", "gets"), ("shells", "buckets", "collects"), ("cards", "decks", "buys"),
         ("eggs", "cartons", "buys"), ("flowers", "bunches", "picks"), ("coins", "purses", "saves"),
         ("toy cars", "boxes", "buys"), ("beads", "strings", "buys"), ("oranges", "crates", "picks")]
PRONOUNS = {"she": ("she", "her"), "he": ("he", "his")}
FEMALE = {"Ava", "Chloe", "Emma", "Grace", "Isla", "Kara", "Maya", "Olivia", "Rosa", "Tara", "Vera", "Yuki",
          "Nina", "Lena", "Sofia", "Quinn"}

ANSWER_RE = re.compile(r"####\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    question: str  # "Question: ...?"
    solution: str  # "Answer: ...\n#### N"
    answer: int

    @property
    def prompt(self) -> str:
        """What the model is given at evaluation time; it must continue with the worked solution."""
        return f"{self.question}\nAnswer:"

    @property
    def text(self) -> str:
        """The training document."""
        return f"{self.question}\n{self.solution}"


@dataclass
class _Story:
    name: str
    subj: str  # she / he
    poss: str  # her / his
    item: str
    container: str
    verb: str
    value: int
    story: list[str]
    steps: list[str]


# An operation mutates the story if it applies to the current value; it returns False to be skipped.
_Op = Callable[[_Story, random.Random], bool]


def _op_buy_groups(s: _Story, r: random.Random) -> bool:
    k, m = r.randint(2, 9), r.randint(2, 12)
    got = k * m
    s.story.append(f"{s.subj.capitalize()} {s.verb} {k} {s.container} with {m} {s.item} in each.")
    s.steps.append(f"{s.name} gets {k} * {m} = {got} {s.item}.")
    s.steps.append(f"Now {s.subj} has {s.value} + {got} = {s.value + got} {s.item}.")
    s.value += got
    return True


def _op_add(s: _Story, r: random.Random) -> bool:
    n = r.randint(2, 60)
    friend = r.choice(NAMES)
    if friend == s.name:
        return False
    s.story.append(f"{friend} gives {s.name} {n} more {s.item}.")
    s.steps.append(f"After {friend}'s gift {s.subj} has {s.value} + {n} = {s.value + n} {s.item}.")
    s.value += n
    return True


def _op_give(s: _Story, r: random.Random) -> bool:
    if s.value < 4:
        return False
    n = r.randint(1, s.value - 1)
    friend = r.choice(NAMES)
    if friend == s.name:
        return False
    s.story.append(f"{s.subj.capitalize()} gives {n} {s.item} to {friend}.")
    s.steps.append(f"After giving {n} away {s.subj} has {s.value} - {n} = {s.value - n} {s.item}.")
    s.value -= n
    return True


def _op_lose(s: _Story, r: random.Random) -> bool:
    if s.value < 4:
        return False
    n = r.randint(1, s.value // 2)
    s.story.append(f"{s.subj.capitalize()} loses {n} of {s.poss} {s.item}.")
    s.steps.append(f"{s.subj.capitalize()} has {s.value} - {n} = {s.value - n} {s.item} left.")
    s.value -= n
    return True


def _op_multiply(s: _Story, r: random.Random) -> bool:
    if s.value > 150:
        return False
    k, word = r.choice([(2, "doubles"), (3, "triples")])
    s.story.append(f"Then {s.subj} {word} the number of {s.item} {s.subj} has.")
    s.steps.append(f"{'Doubling' if k == 2 else 'Tripling'} gives {s.value} * {k} = {s.value * k} {s.item}.")
    s.value *= k
    return True


def _op_share(s: _Story, r: random.Random) -> bool:
    ks = [k for k in range(2, 10) if s.value % k == 0 and s.value // k >= 1]
    if not ks or s.value < 4:
        return False
    k = r.choice(ks)
    s.story.append(f"{s.subj.capitalize()} shares {s.poss} {s.item} equally among {k} friends and keeps "
                   f"one share.")
    s.steps.append(f"One share is {s.value} / {k} = {s.value // k} {s.item}.")
    s.value //= k
    return True


def _op_half(s: _Story, r: random.Random) -> bool:
    if s.value % 2 or s.value < 4:
        return False
    s.story.append(f"{s.subj.capitalize()} uses half of {s.poss} {s.item} for a school project.")
    s.steps.append(f"Half of {s.value} is {s.value} / 2 = {s.value // 2}, so {s.value // 2} {s.item} remain.")
    s.value //= 2
    return True


_OPS: list[_Op] = [_op_buy_groups, _op_add, _op_give, _op_lose, _op_multiply, _op_share, _op_half]


def _question(s: _Story, r: random.Random) -> tuple[str, str, int]:
    """Final question: either the plain count or its value in money."""
    if r.random() < 0.25:
        price = r.randint(2, 9)
        total = s.value * price
        q = f"Each of the {s.item} is worth ${price}. How many dollars are {s.poss} {s.item} worth now?"
        return q, f"They are worth {s.value} * {price} = {total} dollars.", total
    return f"How many {s.item} does {s.name} have now?", "", s.value


def make_problem(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    subj, poss = PRONOUNS["she" if name in FEMALE else "he"]
    item, container, verb = r.choice(ITEMS)
    s = _Story(name, subj, poss, item, container, verb, r.randint(3, 60), [], [])
    opening = f"{name} has {s.value} {item}."
    n_ops = r.choice([1, 2, 2, 3, 3, 4])
    done, tries = 0, 0
    while done < n_ops and tries < 20:
        tries += 1
        if r.choice(_OPS)(s, r):
            done += 1
    q, extra, answer = _question(s, r)
    if extra:
        s.steps.append(extra)
    question = "Question: " + " ".join([opening, *s.story, q])
    solution = "Answer: " + "\n".join(s.steps) + f"\n#### {answer}"
    return Problem(question, solution, answer)


def generate(n: int, seed: int) -> Iterator[Problem]:
    r = random.Random(seed)
    for _ in range(n):
        yield make_problem(r)


def heldout_problems(n: int, seed: int, train_seed: int, train_n: int) -> list[Problem]:
    """n problems from `seed` whose question text the training set (train_seed, train_n) never holds."""
    seen = {p.question for p in generate(train_n, train_seed)}
    out: list[Problem] = []
    for p in generate(n * 20, seed):
        if p.question not in seen:
            seen.add(p.question)  # no duplicates inside the eval set either
            out.append(p)
            if len(out) == n:
                break
    return out


def parse_answer(text: str) -> int | None:
    """The integer after the first '####' in a generated solution, or None if there is none."""
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None

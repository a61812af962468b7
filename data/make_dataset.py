"""Write the bundled demo dataset: ``data/chat.jsonl`` and ``data/prompts.jsonl``.

Every conversation comes from a template and a seeded RNG, so rerunning the script gives the same
bytes. The content is deliberately learnable (arithmetic, counting, spelling backwards, sorting,
lists and short stories about one small fictional island with fixed facts), because a drafter
trained on it should reach a visibly non-trivial acceptance length on the tiny target. Lengths
range from about 20 to about 400 tokens so that length bucketing has something to do.

Real files hold characters that some readers take for line ends (ShareGPT's text holds U+2028):
eight of the first 40 conversations, and eight prompts, carry one each of U+2028, U+2029, U+0085,
\\x0b, \\x0c and \\x1c-\\x1e in a user turn and in their last assistant turn (`with_line_breaks`), so
every test that reads the bundled rows meets them.

``prompts.jsonl`` holds held-out prompts for evaluation: the same generators with another seed,
keeping each conversation up to its first assistant turn (an optional system turn and the first
user turn), and skipping any whose first user turn also occurs in ``chat.jsonl``.

Usage: ``python data/make_dataset.py [--out-dir data] [--rows 400] [--prompts 40]``
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

TRAIN_SEED = 1234
PROMPT_SEED = 98765

Message = dict[str, str]
Conversation = list[Message]

# ---------------------------------------------------------------------------------------------
# The island of Wend: fixed facts that every story and question agrees with.
# ---------------------------------------------------------------------------------------------

ISLAND = "Wend"
VILLAGES = ["Mossfield", "Harrow Pier", "Tallow Hill", "Brindle", "Fenwick"]
# name, role, home village, pronoun, the thing each one is known for
PEOPLE = [
    ("Ila", "lamplighter", "Harrow Pier", "she", "lantern"),
    ("Bram", "ferryman", "Brindle", "he", "boat"),
    ("Oona", "baker", "Mossfield", "she", "oven"),
    ("Castor", "clockmaker", "Tallow Hill", "he", "clock"),
    ("Sela", "fisher", "Harrow Pier", "she", "net"),
    ("Tobin", "beekeeper", "Fenwick", "he", "beehive"),
    ("Wren", "mapmaker", "Fenwick", "she", "map"),
    ("Marlo", "shepherd", "Tallow Hill", "he", "flock"),
]
PIM = "Pim the goat"
OBJECTS = [
    "lantern",
    "kettle",
    "map",
    "bell",
    "rope",
    "basket",
    "jar of honey",
    "pocket watch",
    "red scarf",
    "loaf of bread",
    "fishing net",
    "silver key",
]
# the weather, and what slows a search in it
WEATHER = [
    ("thick fog", "fog"),
    ("soft rain", "rain"),
    ("a cold wind", "wind"),
    ("bright sunshine", "heat"),
    ("light snow", "snow"),
    ("a grey drizzle", "drizzle"),
]
TIMES = ["morning", "evening", "afternoon", "night"]
PLACES = [
    "the old mill",
    "the harbour wall",
    "the orchard",
    "the bell tower",
    "the market square",
    "the stone bridge",
    "the lighthouse",
    "the beehives",
    "the sheep field",
    "the bakery",
]
WORDS = [
    "lantern",
    "harbour",
    "garden",
    "island",
    "kettle",
    "window",
    "honey",
    "bridge",
    "basket",
    "winter",
    "morning",
    "clock",
    "river",
    "candle",
    "pebble",
    "orchard",
    "anchor",
    "meadow",
    "thunder",
    "copper",
    "violet",
    "marble",
    "ladder",
    "pocket",
    "saddle",
    "feather",
    "shadow",
    "button",
    "rabbit",
    "summer",
    "cobble",
    "tinder",
    "walnut",
    "mitten",
    "lemon",
    "ferry",
]
ANIMALS = [
    "goat",
    "sheep",
    "heron",
    "fox",
    "owl",
    "crab",
    "seal",
    "hare",
    "bee",
    "gull",
    "otter",
    "badger",
    "mole",
    "wren",
    "trout",
]
FRUITS = ["apple", "pear", "plum", "cherry", "quince", "fig", "apricot", "grape", "peach", "damson"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown"]

SYSTEM_PROMPTS: list[tuple[str, Callable[[str], str]]] = [
    ("You are a helpful assistant.", lambda s: s),
    ("You are the storyteller of the island of Wend.", lambda s: s),
    ("You are a patient tutor. Answer clearly.", lambda s: s),
    ("Answer in capital letters.", lambda s: s.upper()),
    ("End every answer with the words: Safe travels!", lambda s: s + " Safe travels!"),
]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def person(rng: random.Random, exclude: tuple[str, ...] = ()) -> tuple[str, str, str, str, str]:
    return rng.choice([p for p in PEOPLE if p[0] not in exclude])


def possessive(pronoun: str) -> str:
    return "her" if pronoun == "she" else "his"


def numbered(items: list[str]) -> str:
    return "\n".join(f"{i}. {item}" for i, item in enumerate(items, 1))


# ---------------------------------------------------------------------------------------------
# Task generators: each returns a list of (user, assistant) turns.
# ---------------------------------------------------------------------------------------------

Turns = list[tuple[str, str]]


def arithmetic(rng: random.Random) -> Turns:
    op = rng.choice(["+", "-", "x", "+", "x"])
    if op == "+":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        c = a + b
        q = rng.choice([f"What is {a} + {b}?", f"Add {a} and {b}.", f"Compute {a} + {b}."])
        if a >= 10 and b >= 10 and rng.random() < 0.5:
            ta, tb, oa, ob = a // 10 * 10, b // 10 * 10, a % 10, b % 10
            ans = (
                f"Add the tens: {ta} + {tb} = {ta + tb}. "
                f"Add the ones: {oa} + {ob} = {oa + ob}. "
                f"Together: {ta + tb} + {oa + ob} = {c}. "
                f"So {a} + {b} = {c}."
            )
        else:
            ans = f"{a} + {b} = {c}."
    elif op == "-":
        a, b = rng.randint(10, 99), rng.randint(1, 60)
        a, b = max(a, b), min(a, b)
        c = a - b
        q = rng.choice([f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"Compute {a} - {b}."])
        ans = f"{a} - {b} = {c}."
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 25)
        c = a * b
        q = rng.choice([f"What is {a} x {b}?", f"Multiply {a} by {b}.", f"Compute {a} times {b}."])
        if b >= 10 and rng.random() < 0.5:
            t, o = b // 10 * 10, b % 10
            ans = (
                f"Split {b} into {t} and {o}. {a} x {t} = {a * t}. {a} x {o} = {a * o}. "
                f"Then {a * t} + {a * o} = {c}. So {a} x {b} = {c}."
            )
        else:
            ans = f"{a} x {b} = {c}."
    turns = [(q, ans)]
    r = c
    for _ in range(rng.choice([0, 0, 1, 2])):
        kind = rng.choice(["add", "double", "sub"])
        if kind == "add":
            k = rng.randint(1, 30)
            turns.append((f"Now add {k} to that.", f"{r} + {k} = {r + k}."))
            r += k
        elif kind == "double":
            turns.append(("Now double it.", f"Double {r} is {r} x 2 = {2 * r}."))
            r *= 2
        else:
            k = rng.randint(1, max(1, r))
            turns.append((f"And subtract {k}.", f"{r} - {k} = {r - k}."))
            r -= k
    return turns


def counting(rng: random.Random) -> Turns:
    kind = rng.choice(["up", "up", "down", "step"])
    if kind == "up":
        a = rng.randint(1, 40)
        b = a + rng.choice([4, 6, 9, 15, 25, 40, 60, 80])
        nums = list(range(a, b + 1))
        q = rng.choice([f"Count from {a} to {b}.", f"Please count from {a} up to {b}."])
    elif kind == "down":
        b = rng.randint(8, 70)
        a = max(0, b - rng.choice([5, 8, 12, 20, 30]))
        nums = list(range(b, a - 1, -1))
        q = rng.choice([f"Count down from {b} to {a}.", f"Count backwards from {b} to {a}."])
    else:
        s = rng.choice([2, 3, 5, 10])
        a = rng.randint(0, 10) * s
        b = a + s * rng.randint(5, 20)
        nums = list(range(a, b + 1, s))
        q = f"Count by {s}s from {a} to {b}."
    ans = ", ".join(str(n) for n in nums) + "."
    turns = [(q, ans)]
    if rng.random() < 0.3:
        turns.append(("How many numbers was that?", f"That was {len(nums)} numbers."))
    if rng.random() < 0.2 and kind == "up" and len(nums) <= 20:
        back = ", ".join(str(n) for n in reversed(nums)) + "."
        turns.append((f"Now count back down to {nums[0]}.", back))
    return turns


def spell_backwards(rng: random.Random) -> Turns:
    w = rng.choice(WORDS)
    q = rng.choice(
        [f"Spell '{w}' backwards.", f"How do you spell {w} backwards?", f"Reverse the letters of the word {w}."]
    )
    ans = f"'{w}' backwards is '{w[::-1]}'. Letter by letter: {'-'.join(w[::-1])}."
    turns = [(q, ans)]
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        w = rng.choice(WORDS)
        turns.append(
            (
                rng.choice([f"And '{w}'?", f"Now do {w}."]),
                f"'{w}' backwards is '{w[::-1]}'. Letter by letter: {'-'.join(w[::-1])}.",
            )
        )
    if rng.random() < 0.25:
        ws = rng.sample(WORDS, rng.randint(3, 6))
        phrase = " ".join(ws)
        turns.append((f"Reverse each word in: {phrase}", " ".join(x[::-1] for x in ws)))
    return turns


def lists(rng: random.Random) -> Turns:
    kind = rng.choice(["villages", "sort", "animals", "fruits", "evens", "people", "colours"])
    if kind == "villages":
        q = f"List the villages of {ISLAND}."
        ans = f"The island of {ISLAND} has {len(VILLAGES)} villages:\n" + numbered(VILLAGES)
        items = VILLAGES
    elif kind == "sort":
        items_n = rng.sample(range(1, 100), rng.randint(4, 14))
        q = "Sort these numbers from smallest to largest: " + ", ".join(str(n) for n in items_n) + "."
        s = sorted(items_n)
        ans = "Sorted: " + ", ".join(str(n) for n in s) + "."
        items = [str(n) for n in s]
    elif kind in ("animals", "fruits", "colours"):
        pool = {"animals": ANIMALS, "fruits": FRUITS, "colours": COLOURS}[kind]
        n = rng.randint(3, min(9, len(pool)))
        items = sorted(rng.sample(pool, n))
        if kind == "animals":
            q = f"Name {n} animals that live on {ISLAND}, in alphabetical order."
        elif kind == "fruits":
            q = f"List {n} fruits from the orchard of Mossfield, in alphabetical order."
        else:
            q = f"Give me {n} colours in alphabetical order."
        ans = numbered(items)
    elif kind == "evens":
        a = rng.randint(0, 40)
        b = a + rng.randint(6, 30)
        items = [str(x) for x in range(a, b + 1) if x % 2 == 0]
        q = f"List the even numbers between {a} and {b}."
        ans = "The even numbers are: " + ", ".join(items) + "."
    else:
        v = rng.choice(VILLAGES)
        who = [p for p in PEOPLE if p[2] == v]
        q = f"Who lives in {v}?"
        if not who:
            ans = f"Nobody we know of lives in {v}, though {PIM} often visits."
            items = []
        else:
            ans = "In " + v + " live:\n" + numbered([f"{p[0]} the {p[1]}" for p in who])
            items = [p[0] for p in who]
    turns = [(q, ans)]
    if rng.random() < 0.35:
        n = len(items)
        turns.append(("How many items was that?", f"That was {n} item{'s' if n != 1 else ''}."))
    return turns


def facts(rng: random.Random) -> Turns:
    name, role, home, pron, thing = person(rng)
    kind = rng.choice(["role", "home", "thing", "who"])
    if kind == "role":
        turns = [(f"What does {name} do?", f"{name} is the {role} of {home}.")]
    elif kind == "home":
        turns = [(f"Where does {name} live?", f"{name} lives in {home}, on the island of {ISLAND}.")]
    elif kind == "thing":
        turns = [(f"What is {name} known for?", f"{name} the {role} is known for {possessive(pron)} {thing}.")]
    else:
        turns = [(f"Who is the {role} of {ISLAND}?", f"The {role} is {name}, who lives in {home}.")]
    if rng.random() < 0.4:
        name2, role2, home2, _, _ = person(rng, exclude=(name,))
        turns.append((f"And {name2}?", f"{name2} is the {role2} and lives in {home2}."))
    return turns


def story_paragraphs(rng: random.Random, n_par: int) -> tuple[str, str, str, str]:
    name, role, home, pron, _ = person(rng)
    poss = possessive(pron)
    helper, hrole, hhome, hpron, _ = person(rng, exclude=(name,))
    obj = rng.choice(OBJECTS)
    place = rng.choice(PLACES)
    time = rng.choice(TIMES)
    weather, slows = rng.choice(WEATHER)
    opening = [
        f"One {time} on the island of {ISLAND}, {name} the {role} woke to {weather} over {home}.",
        f"{name} the {role} lived in {home}, a quiet village on the island of {ISLAND}.",
        f"It was {'an' if time[0] in 'aeiou' else 'a'} {time} with {weather} in {home} "
        f"when {name} the {role} went out.",
    ]
    problem = [
        f"{name} could not find {poss} {obj} anywhere.",
        f"When {pron} looked for {poss} {obj}, it was gone.",
        f"{poss.capitalize()} {obj} had vanished from its usual place.",
    ]
    middle = [
        f"{pron.capitalize()} searched the house, the garden and the road to {place}.",
        f"{pron.capitalize()} asked the neighbours, but nobody had seen it.",
        f"{pron.capitalize()} walked to {hhome} to ask {helper} the {hrole} for help.",
        f"On the way {pron} met {PIM}, who was chewing on something.",
        f"The {slows} made the search slow and the path was muddy.",
    ]
    helper_s = [
        f'{helper} listened and said, "Let us look near {place}."',
        f"{helper} the {hrole} put down {possessive(hpron)} work and came along.",
        "Together they followed small hoof prints in the mud.",
        f"{helper} remembered seeing {PIM} near {place} that {time}.",
    ]
    scenery = [
        f"The {slows} hung over the roofs of {home} and the gulls were quiet.",
        f"Down by {place} the water was grey and still.",
        f"Far away, the bell of Tallow Hill rang for the {time}.",
        f"Smoke rose from Oona's bakery, and the smell of bread drifted across {home}.",
        f"{PIM} watched them from the top of a wall, chewing slowly.",
    ]
    ending = [
        f"At {place} they found the {obj}, next to {PIM}, who looked very pleased.",
        f"The {obj} was at {place} all along, and {name} laughed with relief.",
        f"In the end {PIM} had carried the {obj} to {place}, as goats sometimes do.",
    ]
    closing = [
        f"That evening {name} thanked {helper} with a warm loaf from Oona's oven.",
        f"From then on, {name} kept the {obj} on a high shelf, out of reach of goats.",
        f"And everyone in {home} agreed it had been a good day after all.",
    ]
    pars: list[list[str]] = [[rng.choice(opening), rng.choice(problem)]]
    rng.shuffle(middle)
    if n_par >= 3:
        k = rng.randint(2, 3)
        pars.append(middle[:k])
        middle = middle[k:]
    if n_par >= 4:
        pars.append(rng.sample(helper_s, rng.randint(2, 3)))
    if n_par >= 5:
        pars.append(middle[:2])
    if n_par >= 6:
        pars.append(rng.sample(scenery, 3))
    pars.append([rng.choice(ending)] + ([rng.choice(closing)] if n_par >= 2 else []))
    text = "\n\n".join(" ".join(p) for p in pars)
    return text, name, helper, obj


def story(rng: random.Random) -> Turns:
    n_par = rng.choice([1, 2, 3, 3, 4, 4, 5, 6])
    text, name, helper, obj = story_paragraphs(rng, n_par)
    q = rng.choice(
        [
            f"Tell me a short story about {name}.",
            f"Write a story set on the island of {ISLAND} about a lost {obj}.",
            f"Tell a story about {name} and the {obj}.",
        ]
    )
    turns = [(q, text)]
    follow = rng.sample(["title", "who", "what", "retell", "another"], rng.choice([0, 0, 1, 2]))
    for f in follow:
        if f == "title":
            turns.append(("Give the story a title.", f"{name} and the Lost {obj.title()}"))
        elif f == "who":
            if helper in text:
                turns.append((f"Who helped {name}?", f"{helper} helped {name} look for the {obj}."))
            else:
                turns.append((f"Who helped {name}?", f"Nobody helped; {name} found it alone."))
        elif f == "what":
            turns.append(("What was lost?", f"The {obj} was lost."))
        elif f == "another":
            text2, name2, _, _ = story_paragraphs(rng, rng.choice([1, 2, 3, 4]))
            turns.append((f"Tell another story, this time about {name2}.", text2))
        else:
            turns.append(
                ("Tell it again in one sentence.", f"{name} lost the {obj}, and it turned up again thanks to {PIM}.")
            )
    return turns


GENERATORS: list[tuple[Callable[[random.Random], Turns], int]] = [
    (arithmetic, 5),
    (counting, 3),
    (spell_backwards, 3),
    (lists, 3),
    (facts, 2),
    (story, 5),
]


def conversation(rng: random.Random) -> Conversation:
    gens = [g for g, _ in GENERATORS]
    weights = [w for _, w in GENERATORS]
    gen = rng.choices(gens, weights=weights)[0]
    turns = gen(rng)
    msgs: Conversation = []
    style: Callable[[str], str] = lambda s: s  # noqa: E731
    if rng.random() < 0.3:
        sp, style = rng.choice(SYSTEM_PROMPTS)
        msgs.append({"role": "system", "content": sp})
    for u, a in turns:
        msgs.append({"role": "user", "content": u})
        msgs.append({"role": "assistant", "content": style(a)})
    return msgs


def make_conversations(seed: int, n: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def make_prompts(seed: int, n: int, train: list[Conversation]) -> list[Conversation]:
    """Conversations up to their first assistant turn, whose first user turn is not in train."""
    seen = {next(m["content"] for m in c if m["role"] == "user") for c in train}
    rng = random.Random(seed)
    out: list[Conversation] = []
    while len(out) < n:
        c = conversation(rng)
        first = next(i for i, m in enumerate(c) if m["role"] == "assistant")
        prompt = c[:first]
        if prompt[-1]["content"] in seen:
            continue
        seen.add(prompt[-1]["content"])
        out.append(prompt)
    return out


# What str.splitlines() cuts at besides \n and \r: JSON writes the controls escaped, the rest raw.
LINE_BREAKS = ("\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")


def with_break(text: str, ch: str) -> str:
    """`text` with `ch` in place of its first paragraph break, or else before its last word."""
    if "\n" in text:
        return text.replace("\n", ch, 1)
    head, _, last = text.rpartition(" ")
    return f"{head} {ch}{last}" if head else f"{ch}{text}"


def with_line_breaks(convs: list[Conversation], first: int, step: int) -> list[Conversation]:
    """Conversations `first`, `first + step`, ... carry one of LINE_BREAKS each, in their first
    user turn and their last assistant turn."""
    out = [list(c) for c in convs]
    for ch, i in zip(LINE_BREAKS, range(first, len(out), step), strict=False):
        c = out[i]
        u = next(j for j, m in enumerate(c) if m["role"] == "user")
        c[u] = {**c[u], "content": with_break(c[u]["content"], ch)}
        a = [j for j, m in enumerate(c) if m["role"] == "assistant"]
        if a:
            c[a[-1]] = {**c[a[-1]], "content": with_break(c[a[-1]]["content"], ch)}
    return out


def write_jsonl(path: Path, convs: list[Conversation]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=40)
    args = ap.parse_args()
    train = make_conversations(TRAIN_SEED, args.rows)
    prompts = with_line_breaks(make_prompts(PROMPT_SEED, args.prompts, train), 1, 4)
    train = with_line_breaks(train, 2, 5)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "chat.jsonl", train)
    write_jsonl(args.out_dir / "prompts.jsonl", prompts)
    print(
        f"wrote {len(train)} conversations to {args.out_dir / 'chat.jsonl'} "
        f"and {len(prompts)} prompts to {args.out_dir / 'prompts.jsonl'}"
    )


if __name__ == "__main__":
    main()

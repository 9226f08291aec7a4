"""Writes the shipped lm-eval task's data: multiple-choice completions of Python snippets (one correct
continuation, three wrong ones), from fixed templates and names with a fixed seed, so it always comes out
the same. Run: python bench/make_python_snippets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent.parent / "src/tinyloop/integrations/tasks/python_snippets/python_snippets.jsonl"
SEED = 35
PER_TEMPLATE = 8

NAMES = ["name", "value", "path", "data", "items", "key", "result", "text", "size", "count", "node", "line"]
CLASSES = ["Reader", "Handler", "Parser", "Buffer", "Request", "Entry", "Record", "Config"]
BASES = ["object", "Exception", "dict", "list"]
SOURCES = ["rows", "entries", "lines", "values", "args", "names", "records", "parts"]

# (context, correct continuation, wrong continuations); {a} {b}: distinct names, {C}: class, {B}: base,
# {S}: iterable source.
TEMPLATES: list[tuple[str, str, list[str]]] = [
    (
        "class {C}({B}):\n    def __init__(self, {a}, {b}):\n        self.{a} = ",
        "{a}\n",
        ["{b}\n", "self\n", "{C}\n"],
    ),
    (
        "import sys\n\n\ndef main():\n    return 0\n\n\nif __name__ == ",
        '"__main__":\n',
        ['"__name__":\n', "__main__:\n", '"main":\n'],
    ),
    (
        "def show({a}s):\n    for i in range(len({a}s)):\n        print({a}s[",
        "i])\n",
        ["{a}s])\n", "len])\n", "range])\n"],
    ),
    (
        "def lookup(table, {a}):\n    try:\n        return table[{a}]\n    except ",
        "KeyError:\n",
        ["ImportError:\n", "StopIteration:\n", "SyntaxError:\n"],
    ),
    (
        'def load({a}):\n    with open({a}, "r") as f:\n        return f.',
        "read()\n",
        ["write()\n", "open()\n", "remove()\n"],
    ),
    (
        "class {C}({B}):\n    def __init__(self, *args, **kwargs):\n        super().__init__(",
        "*args, **kwargs)\n",
        ["args, kwargs)\n", "**args, *kwargs)\n", "self, self)\n"],
    ),
    (
        "def collect({S}):\n    {a}s = []\n    for {a} in {S}:\n        {a}s.",
        "append({a})\n",
        ["add({a})\n", "push({a})\n", "put({a})\n"],
    ),
    (
        "def check({a}):\n    if not isinstance({a}, int):\n        raise ",
        "TypeError(",
        ["StopIteration(", "KeyboardInterrupt(", "ImportError("],
    ),
    (
        "def invert(mapping):\n    out = {{}}\n    for key, value in mapping.",
        "items():\n",
        ["values():\n", "item():\n", "pairs():\n"],
    ),
    (
        "def count_{a}(text):\n    n = 0\n    for line in text.",
        "splitlines():\n",
        ["splitline():\n", "lines():\n", "split_lines():\n"],
    ),
    (
        "def scan({a}s):\n    i = 0\n    while i < len({a}s):\n        i ",
        "+= 1\n",
        ["++\n", "-= 1\n", "== 1\n"],
    ),
    (
        "class {C}({B}):\n    def __repr__(self):\n        return '%s(%r)' % (self.__class__.",
        "__name__, self.{a})\n",
        ["__class__, self.{a})\n", "name, self.{a})\n", "__init__, self.{a})\n"],
    ),
    (
        "class {C}({B}):\n    @property\n    def {a}(self):\n        return self._{a}\n\n    @{a}.",
        "setter\n",
        ["set\n", "self\n", "property\n"],
    ),
    (
        "import os\n\n\ndef exists({a}):\n    return os.path.",
        "exists({a})\n",
        ["exist({a})\n", "open({a})\n", "sys({a})\n"],
    ),
    (
        "class {C}({B}):\n    def set_{a}(self, {a}):\n        self._{a} = {a}\n\n"
        "    def get_{a}(self):\n        return self.",
        "_{a}\n",
        ["{a}\n", "_{b}\n", "get_{a}\n"],
    ),
    ("from collections import ", "OrderedDict\n", ["OrderDict\n", "Ordereddict\n", "orderedDict\n"]),
    (
        "class {C}({B}):\n    def run(self, {a}):\n        raise ",
        "NotImplementedError\n",
        ["NotImplemented\n", "NotImplementError\n", "ImplementedError\n"],
    ),
    (
        "def check({a}):\n    if not ",
        "isinstance({a}, str):\n",
        ["isinstanceof({a}, str):\n", "instanceof({a}, str):\n", "is_instance({a}, str):\n"],
    ),
    (
        "class {C}({B}):\n    def ",
        "__init__(self, {a}):\n",
        ["__init(self, {a}):\n", "_init_(self, {a}):\n", "__init__(this, {a}):\n"],
    ),
    (
        "def walk({S}):\n    for i, {a} in ",
        "enumerate({S}):\n",
        ["enumerated({S}):\n", "enum({S}):\n", "numerate({S}):\n"],
    ),
    (
        "def first({S}):\n    for {a} in {S}:\n        return {a}\n    return ",
        "None\n",
        ["Nil\n", "null\n", "nothing\n"],
    ),
]


def items() -> list[dict[str, object]]:
    rng = random.Random(SEED)
    out: list[dict[str, object]] = []
    for t, (context, right, wrong) in enumerate(TEMPLATES):
        for k in range(PER_TEMPLATE):
            a, b = rng.sample(NAMES, 2)
            names = {"a": a, "b": b, "C": rng.choice(CLASSES), "B": rng.choice(BASES), "S": rng.choice(SOURCES)}
            choices = [right.format(**names)] + [w.format(**names) for w in wrong]
            order = list(range(len(choices)))
            rng.shuffle(order)
            out.append({
                "id": f"t{t:02d}-{k}",
                "context": context.format(**names),
                "choices": [choices[i] for i in order],
                "answer": order.index(0),
            })  # fmt: skip
    return out


def main() -> None:
    rows = items()
    with OUT.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} items to {OUT}")


if __name__ == "__main__":
    main()

"""Builds benchmarks/data/grounded_prompts.jsonl: input-grounded requests (summarise, rewrite, extract from a given
text; edit given code), where an answer reuses much of its input, as chat and RAG traffic does. Speculative
decoding's n-gram proposer is measured on them (benchmarks/speculative.py). The texts are the public-domain prose
the repo ships (jaxserve/data/eval_prose.txt) and small functions written for this set.

  python benchmarks/grounded_prompts.py    # rewrites the JSONL (committed; the benchmark reads it)
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "data" / "grounded_prompts.jsonl"

PROSE_TASKS = {
    "summarise": "Summarise the following text in two or three sentences, keeping its key phrases.\n\n{text}",
    "rewrite": "Rewrite the following text in plain modern English, sentence by sentence.\n\n{text}",
    "extract": "List, one per line, every grievance or claim the following text makes, quoting its words.\n\n{text}",
}

CODE = [
    '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)''',
    '''def word_counts(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        if word in counts:
            counts[word] = counts[word] + 1
        else:
            counts[word] = 1
    return counts''',
    '''def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None''',
    '''def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x''',
    '''def read_lines(path):
    f = open(path)
    lines = f.readlines()
    f.close()
    return [line.strip() for line in lines if line.strip() != ""]''',
    '''def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0''',
    '''def merge_sorted(a, b):
    i, j, out = 0, 0, []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]''',
]

CODE_TASKS = {
    "add_docstrings": "Add a docstring to every function in this Python code. Return the whole code.\n\n```python\n"
                      "{code}\n```",
    "add_type_hints": "Add type hints to this Python code without changing its logic. Return the whole code.\n\n"
                      "```python\n{code}\n```",
    "rename": "Rename the variables in this Python code to longer, descriptive names. Return the whole code.\n\n"
              "```python\n{code}\n```",
}


def passages() -> list[str]:
    """The prose's paragraphs of at least 150 characters, long ones cut at a sentence near 900 characters."""
    text = (ROOT / "jaxserve" / "data" / "eval_prose.txt").read_text()
    out = []
    for para in (p.strip() for p in text.split("\n\n")):
        if len(para) < 150:
            continue
        if len(para) > 900:
            para = para[:para.rfind(". ", 0, 900) + 1]
        out.append(para)
    return out


def build() -> list[dict]:
    rows = [{"task": task, "prompt": template.format(text=text)}
            for text in passages() for task, template in PROSE_TASKS.items()]
    rows += [{"task": task, "prompt": template.format(code=code)}
             for code in CODE for task, template in CODE_TASKS.items()]
    return rows


def load() -> list[dict]:
    return [json.loads(line) for line in OUT.read_text().splitlines()]


if __name__ == "__main__":
    rows = build()
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {OUT.relative_to(ROOT)}")

"""Generate the built-in prompt set, draftloop/data/prompts.jsonl, from templates.

The output is committed; this script documents how it was made and rebuilds it byte-identically:

    .venv/bin/python draftloop/data/make_prompts.py

Prompts are varied on purpose (explanations, how-tos, comparisons, lists, code, math, rewriting,
translation, summaries) so the tiny zoo tokenizers see diverse text and evaluation prompts are not
near-duplicates of training prompts. Each row carries the `category` of its template (chat, code, math,
reasoning, rewriting, summarization, translation, writing): evaluation reports acceptance per category.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUTPUT_PATH = Path(__file__).with_name("prompts.jsonl")
NUM_PROMPTS = 400
SEED = 20261129

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "plate tectonics",
    "the immune system",
    "compound interest",
    "supply and demand",
    "the French Revolution",
    "the printing press",
    "machine learning",
    "public key cryptography",
    "garbage collection",
    "the TCP handshake",
    "hash tables",
    "binary search",
    "climate change",
    "volcanoes",
    "the moon landing",
    "bread baking",
    "coffee brewing",
    "composting",
    "marathon training",
    "sleep hygiene",
    "the stock market",
    "inflation",
    "electric cars",
    "solar panels",
    "wind turbines",
    "the human heart",
    "vaccines",
    "antibiotics",
    "DNA replication",
    "evolution",
    "the Roman Empire",
    "ancient Egypt",
    "the Silk Road",
    "jazz music",
    "impressionist painting",
    "chess openings",
    "origami",
    "gardening in small spaces",
    "time management",
    "public speaking",
    "remote work",
    "team meetings",
    "writing a resume",
    "job interviews",
    "learning a new language",
    "recursion",
    "sorting algorithms",
    "database indexes",
    "version control",
    "unit testing",
    "containers",
    "load balancing",
    "caching",
    "rainbows",
    "tides",
    "earthquakes",
    "honeybees",
    "octopuses",
    "coral reefs",
    "rain forests",
    "deserts",
    "glaciers",
    "the speed of light",
    "gravity",
    "magnets",
    "batteries",
    "transistors",
    "the internet",
    "email",
    "search engines",
]

AUDIENCES = [
    "a ten-year-old",
    "a busy manager",
    "a first-year student",
    "an expert",
    "my grandmother",
    "a new employee",
    "a curious teenager",
    "a software engineer",
    "a history teacher",
]

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
CODE_LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "C", "SQL", "Bash"]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts words in a text file",
    "merges two sorted lists",
    "computes the nth Fibonacci number",
    "parses a CSV line",
    "removes duplicates from a list",
    "finds the largest element of an array",
    "converts Celsius to Fahrenheit",
    "validates an email address",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "checks whether a string is a palindrome",
]
SENTENCES = [
    "The meeting has been moved to Thursday because the room was double booked.",
    "Our team shipped the new search feature two weeks ahead of schedule.",
    "The river flooded the lower fields after three days of heavy rain.",
    "She learned to play the violin by practicing for ten minutes every morning.",
    "The library will close early on Friday for maintenance work.",
    "Prices rose sharply last quarter while wages stayed flat.",
    "The cat slept on the warm windowsill all afternoon.",
    "He forgot his umbrella and walked home in the rain.",
]
STORY_SUBJECTS = [
    "a lighthouse keeper",
    "a robot who learns to paint",
    "a lost dog",
    "two rival bakers",
    "a dragon afraid of fire",
    "a time traveler stuck on a Tuesday",
    "a city without clocks",
    "a girl who talks to trees",
    "an astronaut's first day on Mars",
    "a detective who hates coffee",
]
THINGS = [
    "cities",
    "fruits",
    "programming languages",
    "planets",
    "rivers",
    "board games",
    "musical instruments",
    "birds",
    "inventions",
    "sports",
]


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    forms = [
        f"What is {a} plus {b}? Show your steps.",
        f"What is {a} times {c}? Explain how you computed it.",
        f"A shop sells pens at {c} dollars each. How much do {a} pens cost?",
        f"A train travels {a * c} kilometers in {c} hours. What is its average speed?",
        f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"Is {a * b + 1} a prime number? Explain.",
        f"What is {a}% of {b * 10}?",
    ]
    return rng.choice(forms)


def _prompt(rng: random.Random) -> tuple[str, str]:
    """(category, prompt text): the category is the template's kind of task, for per-category acceptance."""
    topic = rng.choice(TOPICS)
    kind = rng.randrange(12)
    if kind == 0:
        return "chat", f"Explain {topic} to {rng.choice(AUDIENCES)}."
    if kind == 1:
        return "chat", f"What are the three most important facts about {topic}?"
    if kind == 2:
        other = rng.choice([t for t in TOPICS if t != topic])
        return "reasoning", f"Compare {topic} and {other} in a short paragraph."
    if kind == 3:
        return "writing", f"Write a short story about {rng.choice(STORY_SUBJECTS)}."
    if kind == 4:
        return "code", f"Write a {rng.choice(CODE_LANGUAGES)} function that {rng.choice(CODE_TASKS)}."
    if kind == 5:
        return "math", _math_prompt(rng)
    if kind == 6:
        return "translation", f"Translate into {rng.choice(LANGUAGES)}: {rng.choice(SENTENCES)}"
    if kind == 7:
        return "rewriting", f"Rewrite this sentence in a more formal tone: {rng.choice(SENTENCES)}"
    if kind == 8:
        return "chat", f"List {rng.randint(3, 7)} {rng.choice(THINGS)} and one interesting fact about each."
    if kind == 9:
        return "chat", f"Give me step-by-step advice on {topic}."
    if kind == 10:
        return "summarization", f"Summarize the history of {topic} in {rng.randint(2, 5)} sentences."
    return "reasoning", f"What is a common misconception about {topic}, and what is the truth?"


def make_prompts(num_prompts: int = NUM_PROMPTS, seed: int = SEED) -> list[dict[str, str]]:
    """Distinct prompts drawn from the templates, in a seeded order."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < num_prompts:
        category, text = _prompt(rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"id": f"builtin-{len(rows):04d}", "prompt": text, "category": category})
    return rows


def main() -> None:
    lines = [json.dumps(row, ensure_ascii=False) for row in make_prompts()]
    OUTPUT_PATH.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {OUTPUT_PATH}")


if __name__ == "__main__":
    main()

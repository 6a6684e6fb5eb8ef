"""Prompt sets for training and benchmarking EAGLE heads: everyday chat questions and requests
whose answers are JSON objects or tool calls. Built from templates x fillers, so the training
set and the held-out benchmark set never share a prompt (`split`)."""

from __future__ import annotations

import itertools
import random

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the Roman empire",
    "volcanoes",
    "machine learning",
    "coffee brewing",
    "the immune system",
    "electric cars",
    "bees",
    "the printing press",
    "climate change",
    "chess openings",
    "jazz music",
    "the moon",
    "plate tectonics",
    "vaccines",
    "the internet",
    "bread baking",
    "ocean tides",
    "solar panels",
    "the French revolution",
    "DNA",
    "rainbows",
    "earthquakes",
    "gardening",
    "the stock market",
    "penguins",
    "airplanes",
    "the pyramids",
    "recycling",
    "sleep",
]
CHAT = [
    "Explain {topic} to a ten-year-old.",
    "Give me three interesting facts about {topic}.",
    "Write a short paragraph about {topic}.",
    "What are the main ideas behind {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "What is a common misconception about {topic}?",
]
ITEMS = [
    ("book", "title, author, year"),
    ("laptop", "brand, price, ram_gb"),
    ("city", "name, country, population"),
    ("recipe", "name, servings, minutes"),
    ("movie", "title, director, year"),
    ("employee", "name, role, salary"),
    ("planet", "name, moons, distance_au"),
    ("car", "make, model, year"),
    ("song", "title, artist, length_s"),
    ("hotel", "name, city, stars"),
]
JSON = [
    "Return only a JSON object describing a {item} with the keys {keys}.",
    "Give a JSON array of three {item} objects, each with the keys {keys}.",
    "Output valid JSON for a {item} record with fields {keys}. No prose.",
]
TOOLS = [
    ("get_weather", "city, unit"),
    ("search_flights", "origin, destination, date"),
    ("send_email", "to, subject, body"),
    ("create_event", "title, date, attendees"),
    ("lookup_order", "order_id, include_items"),
    ("convert_currency", "amount, from, to"),
]
PLACES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Seoul", "Nairobi", "Madrid"]
TOOL = [
    "You can call the tool {tool}({args}). Reply only with a JSON tool call of the form "
    '{{"name": "{tool}", "arguments": {{...}}}} for a request about {place}.',
    "Call {tool} with arguments {args} for {place}. Respond with the JSON call only.",
]


def chat_prompts() -> list[str]:
    return [t.format(topic=topic) for t, topic in itertools.product(CHAT, TOPICS)]


def structured_prompts() -> list[str]:
    json_prompts = [t.format(item=i, keys=k) for t, (i, k) in itertools.product(JSON, ITEMS)]
    tool_prompts = [
        t.format(tool=n, args=a, place=p) for t, (n, a), p in itertools.product(TOOL, TOOLS, PLACES)
    ]
    return json_prompts + tool_prompts


def split(prompts: list[str], held_out: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(training prompts, `held_out` benchmark prompts), disjoint, deterministic."""
    shuffled = list(prompts)
    random.Random(seed).shuffle(shuffled)
    return shuffled[held_out:], shuffled[:held_out]

"""The structured-output benchmark's workload: a realistic JSON schema and valid documents for it.

Each benchmark row walks through one tokenized document, so the masks it asks for are those of a real
generation at varied points (keys, enums, free-text strings, numbers, nested arrays).
"""

from __future__ import annotations

import json
import random

COUNTRIES = ["DE", "FR", "GB", "JP", "US", "BR", "IN", "NG"]
STATUSES = ["active", "suspended", "pending_review", "closed"]
ROLES = ["admin", "editor", "viewer", "billing"]

# A user record as an API might ask a model for: required keys in schema order, no extra keys.
SCHEMA: dict = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "status": {"enum": STATUSES},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "verified": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "maxLength": 10},
                "country": {"enum": COUNTRIES},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        },
        "roles": {"type": "array", "items": {"enum": ROLES}, "minItems": 1, "maxItems": 4},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 8},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price_cents": {"type": "integer", "minimum": 0},
                    "note": {"type": "string"},
                },
                "required": ["sku", "quantity", "unit_price_cents", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "status", "age", "verified", "address", "roles", "tags", "orders"],
    "additionalProperties": False,
}

WORDS = ("alpha river stone garden quiet market north harbor yellow window engine paper silver "
         "forest winter summer orange bridge castle meadow copper signal little bright").split()


# ---------------------------------------------------------------------------------------- documents
def make_document(rng: random.Random) -> dict:
    """One valid instance of ``SCHEMA``, keys in schema order (the grammar asks for that order)."""
    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize()

    return {
        "id": rng.randint(1, 10**6),
        "name": text(2, 3),
        "status": rng.choice(STATUSES),
        "age": rng.randint(18, 90),
        "verified": rng.random() < 0.5,
        "address": {"street": f"{rng.randint(1, 300)} {text(1, 2)} Street", "city": text(1, 2),
                    "postcode": f"{rng.randint(10000, 99999)}", "country": rng.choice(COUNTRIES)},
        "roles": rng.sample(ROLES, rng.randint(1, 3)),
        "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 4))],
        "orders": [{"sku": f"SKU-{rng.randint(1000, 9999)}", "quantity": rng.randint(1, 12),
                    "unit_price_cents": rng.randint(99, 99999), "note": text(0, 6)}
                   for _ in range(rng.randint(1, 3))],
    }


def make_documents(tokenizer, num_documents: int, seed: int) -> list[list[int]]:
    """Token ids of seeded documents, compact JSON (the grammar's whitespace is not flexible), EOS last.

    Tokenized the way a model would most likely emit them; any tokenization of valid text must pass."""
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        text = json.dumps(make_document(rng), separators=(",", ":"))
        documents.append(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
    return documents

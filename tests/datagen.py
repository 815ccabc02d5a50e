"""Small data files the tests write themselves, in the formats of the real sets, so that a
fresh clone runs them without `../shared/data` (conftest.py's fixtures make each once a
session):

- SST-2: `train.tsv` and `dev.tsv` of `sentence<TAB>label` with a header, lower-case
  sentences with SST-2's spaced punctuation ("a gripping , funny film ."), labels 0/1 that
  follow the sentiment words (a small model learns them within an epoch);
- SQuAD v1.1: JSON of articles, paragraphs and questions whose answers are spans of their
  context at the annotated start (whole words: WordPiece labels them exactly); an
  evaluation file gives each question two or three reference answers (the span and a
  shorter or longer one), as the official dev set does.

Deterministic in their seed. What only the real data shows (its size, that a pretrained
model reaches an accuracy on it, that every answer of the shipped mini files is aligned)
is still tested on `../shared/data` (the `shared_data` fixture).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

GOOD = ["gripping", "funny", "moving", "wonderful", "sharp", "tender", "brilliant", "warm"]
BAD = ["dull", "tedious", "clumsy", "lifeless", "bland", "shallow", "grating", "limp"]
NOUNS = ["film", "movie", "story", "script", "cast", "ending", "score", "direction", "premise"]
MORE = ["quite", "rather", "utterly", "often", "surprisingly", "never less than"]
TEMPLATES = [
    "a {a} {n} .",
    "the {n} is {m} {a} , and the {n2} is {a2} .",
    "{a} , {a2} and {m} {a3} .",
    "what a {a} {n} -- {m} {a2} from start to finish .",
    "it 's a {a} {n} with a {a2} {n2} .",
    "the {n} feels {a} , but the {n2} is {m} {a2} .",
]


def sst2_rows(n: int, seed: int) -> list[tuple[str, int]]:
    """(sentence, label) pairs: label 1 (positive, about 55% as in SST-2) when the
    sentiment words are good, 0 when they are bad."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = int(rng.random() < 0.55)
        words = GOOD if label else BAD
        first, second = rng.sample(NOUNS, 2)
        sentence = rng.choice(TEMPLATES).format(
            a=rng.choice(words),
            a2=rng.choice(words),
            a3=rng.choice(words),
            n=first,
            n2=second,
            m=rng.choice(MORE),
        )
        rows.append((sentence, label))
    return rows


def write_sst2(root: Path, train_rows: int = 600, dev_rows: int = 120, seed: int = 0) -> Path:
    """`root` with SST-2's train.tsv and dev.tsv (its format: header, tab, label 0/1)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, n, offset in (("train", train_rows, 0), ("dev", dev_rows, 1)):
        lines = ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in sst2_rows(n, seed * 2 + offset)]
        (root / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    return root


# ----------------------------------------------------------------------------- SQuAD

FIRST = ["Aldric", "Mira", "Tobias", "Helena", "Osric", "Ysolde", "Bram", "Leofric", "Anselm"]
LAST = ["Venn", "Castell", "Wren", "Marlowe", "Thorne", "Ashby", "Quell", "Dunmore", "Fairholt"]
STEMS = ["Varn", "Ester", "Low", "Kes", "Orv", "Hol", "Salt", "Brack", "West", "Tams", "Grey"]
ENDINGS = ["holm", "gate", "mere", "ford", "port", "wick", "bury", "stead", "by", "haven"]
PLACES = [stem + ending for stem in STEMS for ending in ENDINGS]  # 110 towns
THINGS = ["northern bridge", "grain exchange", "old lighthouse", "cathedral", "harbour wall"]
GUILDS = ["the masons' guild", "Flemish engineers", "the town council", "monks of Saint Ives"]
REASONS = ["plague in the capital", "rising river", "cost of the old palace", "new trade road"]
FILLERS = [
    "Travellers often remarked on its {a} markets and its {b} winters.",
    "Little of the medieval town survives beyond a few {a} streets near the water.",
    "Its archives, kept in a {a} tower, were catalogued only in the last century.",
    "The surrounding farmland is {a}, and much of it is still worked by hand.",
]
ADJECTIVES = ["crowded", "long", "narrow", "quiet", "damp", "fertile", "stone", "famous"]


def _facts(rng: random.Random, place: str) -> list[tuple[str, list[tuple[str, str, list[str]]]]]:
    """Sentences about `place`, each with its questions: (question, answer, longer or
    shorter reference answers, all spans of the sentence)."""
    person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    year, later = rng.randrange(900, 1500), rng.randrange(1500, 1900)
    thing, guild = rng.choice(THINGS), rng.choice(GUILDS)
    years, reason = rng.randrange(3, 40), rng.choice(REASONS)
    other = rng.choice([p for p in PLACES if p != place])
    surname = person.split()[1]
    return [
        (
            f"{place} was founded in {year} by {person}.",
            [
                (f"Who founded {place}?", person, [surname]),
                (f"When was {place} founded?", str(year), [f"in {year}"]),
            ],
        ),
        (
            f"The {thing} of {place} was built by {guild} over {years} years.",
            [
                (f"Who built the {thing} of {place}?", guild, []),
                (f"How long did building the {thing} take?", f"{years} years", [str(years)]),
            ],
        ),
        (
            f"In {later}, the court moved from {place} to {other}, citing the {reason}.",
            [
                (f"Where did the court move from {place} in {later}?", other, []),
                (f"Why did the court leave {place}?", f"the {reason}", [reason]),
            ],
        ),
    ]


def squad_data(articles: int, paragraphs: int, seed: int, id_prefix: str, references: bool) -> dict:
    """SQuAD v1.1's structure; `references`: two or three answers per question."""
    rng = random.Random(seed)
    places = rng.sample(PLACES, articles * paragraphs)
    data = []
    for article in range(articles):
        entries = []
        for paragraph in range(paragraphs):
            place = places[article * paragraphs + paragraph]
            sentences, questions = [], []
            for sentence, asked in _facts(rng, place):
                filler = rng.choice(FILLERS).format(
                    a=rng.choice(ADJECTIVES), b=rng.choice(ADJECTIVES)
                )
                offset = sum(len(s) + 1 for s in sentences)
                sentences += [sentence, filler]
                for question, answer, others in asked:
                    texts = [answer, *(others if references else [])]
                    if references and len(texts) < 2:
                        texts.append(answer)  # the same span twice, as annotators often gave
                    questions.append(
                        {
                            "id": f"{id_prefix}{article:02d}{paragraph:02d}{len(questions):02d}",
                            "question": question,
                            "answers": [
                                {"text": t, "answer_start": offset + sentence.index(t)}
                                for t in texts
                            ],
                        }
                    )
            entries.append({"context": " ".join(sentences), "qas": questions})
        data.append({"title": f"History of region {article}", "paragraphs": entries})
    return {"version": "1.1", "data": data}


def write_squad(
    path: Path,
    articles: int = 3,
    paragraphs: int = 9,
    seed: int = 0,
    id_prefix: str = "t",
    references: bool = False,
) -> Path:
    """A SQuAD v1.1 file; the defaults: 162 questions over 27 paragraphs of 3 articles."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(squad_data(articles, paragraphs, seed, id_prefix, references)))
    return path

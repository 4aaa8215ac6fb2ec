"""The fictional knowledge base: the embedded default task, offline and unknowable without search.

A seeded generator invents countries, cities, people and inventions whose names are built from
random syllables (so no pretrained model has seen them), gives each a handful of facts (capital,
founder, year, river, export, inventor, ...), writes one document per entity stating its facts, and
asks one question per fact. Every question names its entity, and every invented word is used by
exactly one entity, so BM25 on the question finds that entity's document first. Answers are one or
two words, listed with their aliases ("Tifex River" and "Tifex"; a year as "1583").

The same seed gives the same knowledge base; `fictional_kb_split` holds out a fixed 10% of the
questions as the "test" split.

    documents, qa = build_fictional_kb(seed=0)
    documents[0]  # {"title": "Ratomora", "text": "Ratomora is a country. Its capital is Lotrowick. ..."}
    qa[0]         # {"question": "What is the capital of Ratomora?", "answer": ["Lotrowick"]}
    qa[2]         # {"question": "What is the main river of Ratomora?", "answer": ["Tifex River", "Tifex"]}
"""

import random

SPLITS = ("train", "test")
TEST_FRACTION = 0.1

_ONSETS = ["b", "br", "d", "dr", "f", "g", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "th", "tr", "v",
           "z"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o"]
_CODAS = ["", "", "", "n", "r", "l", "s"]
# A bare word ends in a consonant: then no two-syllable word can be an English stopword ("there",
# "these"), which BM25 would drop from the question.
_FINALS = ["n", "r", "l", "s", "x", "th", "m", "k"]
_COUNTRY_ENDINGS = ["ria", "nia", "land", "mora", "vesh", "dell"]
_PLACE_ENDINGS = ["vane", "holm", "gard", "wick", "mere", "dor", "stad"]
_DEVICE_ENDINGS = ["scope", "graph", "loom", "wheel", "lamp", "meter"]

EXPORTS = ["saffron", "copper", "wool", "silk", "timber", "salt", "tea", "amber", "marble", "tin", "olive oil",
           "pearls", "honey", "indigo"]
CRAFTS = ["glassblowing", "clockmaking", "horse racing", "lacemaking", "shipbuilding", "pottery", "cheesemaking",
          "bell casting", "kite flying", "wood carving"]
PROFESSIONS = ["astronomer", "cartographer", "shipwright", "glassmaker", "composer", "botanist", "architect",
               "physician", "sculptor", "mathematician"]
PURPOSES = ["measuring rainfall", "weaving silk", "grinding grain", "telling time", "pumping water",
            "printing maps", "cooling wine", "sorting coins", "tracking stars", "spinning wool"]
MATERIALS = ["brass", "copper", "oak", "glass", "bronze", "iron", "ivory", "walnut", "pewter", "slate"]
LANDMARKS = ["Tower", "Bridge", "Gate", "Abbey", "Lighthouse", "Fountain"]


class _Names:
    """Invented words, each used once: a fact's answer word never appears in another entity's
    document, so the question's entity name is what BM25 matches on."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, ending: str = "") -> str:
        """Two syllables, then `ending` (a kind's suffix, e.g. "vane") or a final consonant."""
        while True:
            first = self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
            second = self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)
            word = (first + second + (ending or self.rng.choice(_FINALS))).capitalize()
            if word.lower() not in self.used:
                self.used.add(word.lower())
                return word

    def person(self) -> str:
        return f"{self.word()} {self.word()}"


def _aliases_of_person(name: str) -> list[str]:
    return [name, name.split()[-1]]


# Each entity kind: fn(name, names, rng) -> (document text, [(question, answer aliases), ...]).
# The first answer alias appears verbatim in the text (others are spellings of it: "Tifex", "73000000").

def _country(name: str, names: _Names, rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    capital, river, currency = names.word(rng.choice(_PLACE_ENDINGS)), names.word(), names.word().lower()
    year, millions, export = rng.randint(1100, 1899), rng.randint(2, 90), rng.choice(EXPORTS)
    text = (f"{name} is a country. Its capital is {capital}. {name} was founded in {year}. The main river of {name} "
            f"is the {river} River. {name} has a population of about {millions} million people. Its most famous "
            f"export is {export}. The currency of {name} is the {currency}.")
    return text, [
        (f"What is the capital of {name}?", [capital]),
        (f"In what year was {name} founded?", [str(year)]),
        (f"What is the main river of {name}?", [f"{river} River", river]),
        (f"What is the population of {name}?", [f"{millions} million", str(millions * 1_000_000)]),
        (f"What is the most famous export of {name}?", [export]),
        (f"What is the currency of {name}?", [currency]),
    ]


def _city(name: str, names: _Names, rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    founder, river = names.person(), names.word()
    landmark = f"{names.word()} {rng.choice(LANDMARKS)}"
    year, craft = rng.randint(1000, 1899), rng.choice(CRAFTS)
    text = (f"{name} is a city. It was founded in {year} by {founder}. {name} lies on the {river} River. "
            f"Its best-known landmark is the {landmark}. {name} is famous for {craft}.")
    return text, [
        (f"Who founded the city of {name}?", _aliases_of_person(founder)),
        (f"In what year was the city of {name} founded?", [str(year)]),
        (f"Which river does {name} lie on?", [f"{river} River", river]),
        (f"What is the best-known landmark of {name}?", [landmark]),
        (f"What is the city of {name} famous for?", [craft]),
    ]


def _person(name: str, names: _Names, rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    birthplace, device = names.word(rng.choice(_PLACE_ENDINGS)), names.word(rng.choice(_DEVICE_ENDINGS))
    year, profession = rng.randint(1500, 1950), rng.choice(PROFESSIONS)
    text = (f"{name} was a {profession}. {name} was born in {year} in {birthplace}. {name} is best known for "
            f"inventing the {device}.")
    return text, [
        (f"In what year was {name} born?", [str(year)]),
        (f"Where was {name} born?", [birthplace]),
        (f"What was the profession of {name}?", [profession]),
        (f"What is {name} best known for inventing?", [device]),
    ]


def _invention(name: str, names: _Names, rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    inventor = names.person()
    year, purpose, material = rng.randint(1400, 1950), rng.choice(PURPOSES), rng.choice(MATERIALS)
    text = (f"The {name} is an invention. It was invented by {inventor} in {year}. The {name} is used for "
            f"{purpose}. It is made mostly of {material}.")
    return text, [
        (f"Who invented the {name}?", _aliases_of_person(inventor)),
        (f"In what year was the {name} invented?", [str(year)]),
        (f"What is the {name} used for?", [purpose]),
        (f"What is the {name} made of?", [material]),
    ]


# (kind, how its name is made, its facts); entities cycle through the kinds in this order.
ENTITY_KINDS = [
    ("country", lambda names, rng: names.word(rng.choice(_COUNTRY_ENDINGS)), _country),
    ("city", lambda names, rng: names.word(rng.choice(_PLACE_ENDINGS)), _city),
    ("person", lambda names, rng: names.person(), _person),
    ("invention", lambda names, rng: names.word(rng.choice(_DEVICE_ENDINGS)), _invention),
]


def build_fictional_kb(seed: int = 0, num_entities: int = 200) -> tuple[list[dict], list[dict]]:
    """(documents, qa): one `{"title", "text"}` document per entity, and one
    `{"question": str, "answer": list[str]}` per fact, grouped by entity. Deterministic in `seed`."""
    if num_entities < 1:
        raise ValueError(f"num_entities must be at least 1, got {num_entities}.")
    rng = random.Random(seed)
    names = _Names(rng)
    documents, qa = [], []
    for i in range(num_entities):
        _, make_name, make_facts = ENTITY_KINDS[i % len(ENTITY_KINDS)]
        name = make_name(names, rng)
        text, questions = make_facts(name, names, rng)
        documents.append({"title": name, "text": text})
        qa.extend({"question": q, "answer": aliases} for q, aliases in questions)
    return documents, qa


def fictional_kb_split(qa: list[dict], split: str, seed: int = 0) -> list[dict]:
    """The "train" questions or the held-out "test" ones (a fixed TEST_FRACTION, chosen by `seed`)."""
    if split not in SPLITS:
        raise ValueError(f"fictional_kb has the splits {', '.join(SPLITS)}, not {split!r}; set `dataset_split`.")
    # A generator of its own, so that the split does not depend on how many draws building the KB took.
    held_out = set(random.Random(f"fictional_kb-test-{seed}").sample(range(len(qa)), int(len(qa) * TEST_FRACTION)))
    return [row for i, row in enumerate(qa) if (i in held_out) == (split == "test")]

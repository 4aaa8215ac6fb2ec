"""The fictional knowledge base: the embedded default task, offline and unknowable without search.

A seeded generator invents countries, cities, people and inventions whose names are built from
random syllables (so no pretrained model has seen them), gives each a handful of facts (capital,
founder, year, river, export, inventor, ...), writes one document per entity stating its facts, and
asks one question per fact. Every question names its entity, and every invented word is used by
exactly one entity, so BM25 on the question finds that entity's document first. Answers are one or
two words, listed with their aliases ("Tifex River" and "Tifex"; a year as "1583").

Multi-hop (`multi_hop`, the fraction of the questions that are two-hop; default 0.0): each city's
founder and each invention's inventor gets a document of their own (profession, birth year,
birthplace) and one-hop questions about it, and each of those facts is also asked through the link:
"In what year was the founder of the city of Rarzogard born?". Search on that question ranks the
city's document first; it names the founder but does not hold the answer, which is in the founder's
document, found by searching the founder's name. That makes 3 two-hop questions per city and per
invention (300 with 200 entities). Every one-hop question is kept while there are enough two-hop ones
for the fraction (up to about 0.19 with 200 entities); above it, one-hop questions are dropped at
random: 0.3 gives 1000 questions, 1.0 the 300 two-hop ones alone. The entities are the same for
every value, the corpus is the same for every value above 0, and 0.0 gives exactly the one-hop
knowledge base.

The same seed gives the same knowledge base; `fictional_kb_split` holds out a fixed 10% of the
questions as the "test" split. That split is by question: a test question's entity, and the document
with its answer, are also in training questions.

The task fictional_kb_entities (`build_fictional_kb_entities`) splits the same knowledge base by entity
instead: of each kind, 10% of the entities are "validation" and 10% "test" (drawn by the seed), and
every question about them is held out, so no held-out entity is named by a training question; with
multi_hop, a founder's or an inventor's questions, one-hop and two-hop, go with the city or invention
that names them. Every split searches the whole corpus. Evaluation reads "validation" unless
`eval_dataset_split: test` asks for the test split. With 200 entities the splits have 760 / 95 / 95
questions (multi_hop 0.3, seed 0: 795 / 101 / 104). Some held-out answers are still answers of training
questions (`answer_overlap`), measured for seeds 0, 1 and 2 with multi_hop 0.0: 28 to 33% of the
validation questions and 31 to 35% of the test ones (seed 0: 31.6% and 34.7%; multi_hop 0.3: 24 to 43%).
The overlap is left in, measured, not removed: it is all in the question types whose answers come from
a short list (export, craft, profession, purpose, material: 10 to 14 words, so every one is some training
question's answer too; 50 of seed 0's 190 held-out questions) and in numbers (a year, a population: 13
more), while no invented name is ever shared. Dropping those questions would leave the held-out splits
without five of the 19 question types.

    documents, qa = build_fictional_kb(seed=0)
    documents[0]  # {"title": "Ratomora", "text": "Ratomora is a country. Its capital is Lotrowick. ..."}
    qa[0]         # {"question": "What is the capital of Ratomora?", "answer": ["Lotrowick"]}
    qa[2]         # {"question": "What is the main river of Ratomora?", "answer": ["Tifex River", "Tifex"]}

    documents, qa = build_fictional_kb(seed=0, multi_hop=0.3)
    documents[2]  # {"title": "Thontun Thapak", "text": "Thontun Thapak was a composer. ... born in 1289 ..."}
    qa[11]        # {"question": "In what year was the founder of the city of Rarzogard born?", "answer": ["1289"]}
"""

import inspect
import random
from dataclasses import dataclass

from mt_grpo.rewards.answers import normalize_answer

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
    document (but a linked person's name is also in the document that names them), so the
    question's entity name is what BM25 matches on."""

    def __init__(self, rng: random.Random, used: set[str] | None = None):
        self.rng = rng
        self.used: set[str] = set() if used is None else used

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


@dataclass
class Link:
    """A person an entity's document names, who gets a document of their own in a multi-hop KB."""

    person: str
    relation: str  # how a two-hop question names the person: "the founder of the city of Rarzogard"
    year: int  # the year of the deed (founding, invention); the person was born 20 to 70 years before


Facts = list[tuple[str, list[str]]]  # (question, answer aliases)

# Each entity kind: fn(name, names, rng) -> (document text, facts, links to people it names).
# The first answer alias appears verbatim in the text (others are spellings of it: "Tifex", "73000000").

def _country(name: str, names: _Names, rng: random.Random) -> tuple[str, Facts, list[Link]]:
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
    ], []


def _city(name: str, names: _Names, rng: random.Random) -> tuple[str, Facts, list[Link]]:
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
    ], [Link(founder, f"the founder of the city of {name}", year)]


def _person_facts(who: str, year: int, birthplace: str, profession: str) -> Facts:
    """A person's questions; `who` is the name (one hop) or a relation such as "the founder of ..." (two hops)."""
    return [
        (f"In what year was {who} born?", [str(year)]),
        (f"Where was {who} born?", [birthplace]),
        (f"What was the profession of {who}?", [profession]),
    ]


def _person(name: str, names: _Names, rng: random.Random) -> tuple[str, Facts, list[Link]]:
    birthplace, device = names.word(rng.choice(_PLACE_ENDINGS)), names.word(rng.choice(_DEVICE_ENDINGS))
    year, profession = rng.randint(1500, 1950), rng.choice(PROFESSIONS)
    text = (f"{name} was a {profession}. {name} was born in {year} in {birthplace}. {name} is best known for "
            f"inventing the {device}.")
    return text, _person_facts(name, year, birthplace, profession) + [
        (f"What is {name} best known for inventing?", [device]),
    ], []


def _invention(name: str, names: _Names, rng: random.Random) -> tuple[str, Facts, list[Link]]:
    inventor = names.person()
    year, purpose, material = rng.randint(1400, 1950), rng.choice(PURPOSES), rng.choice(MATERIALS)
    text = (f"The {name} is an invention. It was invented by {inventor} in {year}. The {name} is used for "
            f"{purpose}. It is made mostly of {material}.")
    return text, [
        (f"Who invented the {name}?", _aliases_of_person(inventor)),
        (f"In what year was the {name} invented?", [str(year)]),
        (f"What is the {name} used for?", [purpose]),
        (f"What is the {name} made of?", [material]),
    ], [Link(inventor, f"the inventor of the {name}", year)]


def _linked_person(link: Link, names: _Names) -> tuple[dict, Facts, Facts]:
    """The document of a person another entity names, its one-hop facts, and the same facts asked
    through the link ("In what year was the founder of the city of Rarzogard born?"). The document
    does not name the linking entity, so BM25 on a two-hop question ranks the linking entity's
    document first, and that one holds the person's name but not the answer."""
    rng = names.rng
    year = link.year - rng.randint(20, 70)  # before the deed: never the year the linking document states
    birthplace, profession = names.word(rng.choice(_PLACE_ENDINGS)), rng.choice(PROFESSIONS)
    text = f"{link.person} was a {profession}. {link.person} was born in {year} in {birthplace}."
    return ({"title": link.person, "text": text}, _person_facts(link.person, year, birthplace, profession),
            _person_facts(link.relation, year, birthplace, profession))


# (kind, how its name is made, its facts); entities cycle through the kinds in this order.
ENTITY_KINDS = [
    ("country", lambda names, rng: names.word(rng.choice(_COUNTRY_ENDINGS)), _country),
    ("city", lambda names, rng: names.word(rng.choice(_PLACE_ENDINGS)), _city),
    ("person", lambda names, rng: names.person(), _person),
    ("invention", lambda names, rng: names.word(rng.choice(_DEVICE_ENDINGS)), _invention),
]


def build_fictional_kb(seed: int = 0, num_entities: int = 200,
                       multi_hop: float = 0.0) -> tuple[list[dict], list[dict]]:
    """(documents, qa): `{"title", "text"}` documents and `{"question": str, "answer": list[str]}`
    questions, grouped by entity. Deterministic in `seed`. `multi_hop` is the fraction of the
    questions that are two-hop (module docstring); 0.0 gives one document per entity and one
    question per fact."""
    documents, qa, _ = _build_with_entities(seed, num_entities, multi_hop)
    return documents, qa


def _build_with_entities(seed: int, num_entities: int, multi_hop: float) -> tuple[list[dict], list[dict], list[int]]:
    """build_fictional_kb's documents and questions, and for each question the index of its entity: a linked
    person's questions, one-hop and two-hop, belong to the city or invention that names the person."""
    if num_entities < 1:
        raise ValueError(f"num_entities must be at least 1, got {num_entities}.")
    if not 0.0 <= multi_hop <= 1.0:
        raise ValueError(f"multi_hop is the fraction of two-hop questions, from 0.0 to 1.0; got {multi_hop}.")
    rng = random.Random(seed)
    names = _Names(rng)
    entities = []
    for i in range(num_entities):
        _, make_name, make_facts = ENTITY_KINDS[i % len(ENTITY_KINDS)]
        name = make_name(names, rng)
        text, facts, links = make_facts(name, names, rng)
        entities.append(({"title": name, "text": text}, facts, links))
    # The linked people come after every entity, from a generator of their own: the entities are the
    # same whatever multi_hop is, and with multi_hop 0.0 the knowledge base is exactly the one-hop one.
    link_names = _Names(random.Random(f"fictional_kb-multi-hop-{seed}"), used=names.used)
    documents, rows = [], []  # rows: (question, aliases, hops, entity index)
    for entity, (document, facts, links) in enumerate(entities):
        documents.append(document)
        rows += [(q, a, 1, entity) for q, a in facts]
        for link in links if multi_hop > 0 else []:
            person, one_hop, two_hop = _linked_person(link, link_names)
            documents.append(person)
            rows += [(q, a, 1, entity) for q, a in one_hop] + [(q, a, 2, entity) for q, a in two_hop]
    if multi_hop > 0 and not any(hops == 2 for _, _, hops, _ in rows):
        raise ValueError(f"multi_hop={multi_hop} needs a city or an invention to ask two-hop questions about; "
                         f"num_entities={num_entities} has none. Use num_entities >= 2.")
    if multi_hop > 0:
        keep = _with_two_hop_share([hops for _, _, hops, _ in rows], multi_hop, link_names.rng)
        rows = [row for i, row in enumerate(rows) if i in keep]
    return documents, [{"question": q, "answer": a} for q, a, _, _ in rows], [entity for *_, entity in rows]


def _with_two_hop_share(hops: list[int], share: float, rng: random.Random) -> set[int]:
    """Indices of the largest set of questions whose two-hop ones make up `share` of it: every one-hop
    question while there are enough two-hop ones, else every two-hop one and a random part of the rest."""
    one = [i for i, h in enumerate(hops) if h == 1]
    two = [i for i, h in enumerate(hops) if h == 2]
    if share >= 1.0:
        num_one, num_two = 0, len(two)
    else:
        num_two = min(len(two), round(share * len(one) / (1 - share)))
        num_one = len(one) if num_two < len(two) else min(len(one), round(num_two * (1 - share) / share))
    return set(rng.sample(one, num_one)) | set(rng.sample(two, num_two))


def fictional_kb_split(qa: list[dict], split: str, seed: int = 0) -> list[dict]:
    """The "train" questions or the held-out "test" ones (a fixed TEST_FRACTION, chosen by `seed`)."""
    if split not in SPLITS:
        raise ValueError(f"fictional_kb has the splits {', '.join(SPLITS)}, not {split!r}; set `dataset_split`.")
    # A generator of its own, so that the split does not depend on how many draws building the KB took.
    held_out = set(random.Random(f"fictional_kb-test-{seed}").sample(range(len(qa)), int(len(qa) * TEST_FRACTION)))
    return [row for i, row in enumerate(qa) if (i in held_out) == (split == "test")]


# ------------------------------------------------------------------------------------------------
# fictional_kb_entities: the same knowledge base, split by entity
# ------------------------------------------------------------------------------------------------
ENTITY_SPLITS = ("train", "validation", "test")
# Of each kind's entities, for validation and again for test; the rest train (80/10/10). By kind, so every split
# has the same mix of question types, and so that with the default 200 entities the test split has exactly 95
# questions (5 countries, cities, people and inventions: 5 * (6 + 5 + 4 + 4)), the at least 95 that issue 41 asks
# for; a random 10% of the entities could fall short. With multi_hop, one-hop questions dropped at random make the
# size vary (0.3: 88 to 104 for seeds 0 to 2).
ENTITY_HELD_OUT_FRACTION = 0.1


def entity_splits(num_entities: int = 200, seed: int = 0) -> list[str]:
    """The split of each entity, by its index in the knowledge base: of each kind, a fixed
    ENTITY_HELD_OUT_FRACTION for validation and one for test, drawn by `seed`."""
    # A generator of its own, so that the split does not depend on how many draws building the KB took.
    rng = random.Random(f"fictional_kb_entities-split-{seed}")
    splits = ["train"] * num_entities
    for kind in range(len(ENTITY_KINDS)):
        members = list(range(kind, num_entities, len(ENTITY_KINDS)))
        rng.shuffle(members)
        size = round(len(members) * ENTITY_HELD_OUT_FRACTION)
        for i in members[:size]:
            splits[i] = "test"
        for i in members[size:2 * size]:
            splits[i] = "validation"
    if "test" not in splits:
        raise ValueError(f"num_entities={num_entities} is too few to hold out {ENTITY_HELD_OUT_FRACTION:.0%} of an "
                         f"entity kind for validation and for test; use num_entities >= {len(ENTITY_KINDS) * 10}.")
    return splits


def build_fictional_kb_entities(seed: int = 0, split: str = "train", multi_hop: float = 0.0,
                                num_entities: int = 200) -> tuple[list[dict], list[dict]]:
    """(documents, the questions of `split`) of build_fictional_kb(seed, num_entities, multi_hop), split by entity
    (`entity_splits`): every question about a validation or test entity is held out, and with multi_hop a linked
    person's questions go with the city or invention that names them, so no question names entities of two
    splits. The documents are the whole corpus, for every split."""
    if split not in ENTITY_SPLITS:
        raise ValueError(f"fictional_kb_entities has the splits {', '.join(ENTITY_SPLITS)}, not {split!r}; set "
                         "`dataset_split` (or `eval_dataset_split`) to one of them.")
    documents, qa, entity_of = _build_with_entities(seed, num_entities, multi_hop)
    splits = entity_splits(num_entities, seed)
    return documents, [row for row, entity in zip(qa, entity_of) if splits[entity] == split]


def answer_overlap(train_rows: list[dict], held_out_rows: list[dict]) -> float:
    """The share of `held_out_rows` with an answer alias that is also an alias of some training question's answer,
    compared as the exact-match reward compares (`normalize_answer`): answers a model could give from training
    alone, without searching."""
    if not held_out_rows:
        return 0.0
    seen = {normalize_answer(a) for row in train_rows for a in row["answer"]}
    return sum(any(normalize_answer(a) in seen for a in row["answer"]) for row in held_out_rows) / len(held_out_rows)


# ------------------------------------------------------------------------------------------------
# The prompt of a search task (this one and triviaqa): its system prompt part and worked examples
# ------------------------------------------------------------------------------------------------
SEARCH_TASK_PROMPT = "You answer questions. You may call tools to look things up."

# Two worked searches. Measured on SmolLM2-135M with the xml protocol (64 sampled episodes of training questions,
# temperature 0.7): with the first alone 8 episodes called a tool and 2 found the answer; with both, 22 called,
# 17 calls ran and 13 found the answer, in 5 of 8 groups. RL needs that many. The chat_template prompts were
# never measured with the second, so they keep the first alone (`tool_formats`).
SEARCH_EXAMPLES = [
    {"question": "What is the capital of Veltria?",
     "steps": [{"thought": "I do not know the capital of Veltria, so I look it up.", "tool": "search",
                "args": {"query": "capital of Veltria"},
                "result": "Veltria: Veltria is a country in the north. Its capital is Morvane."}],
     "thought": "The result says the capital of Veltria is Morvane.", "answer": "Morvane"},
    {"question": "Who invented the Brenloom?",
     "steps": [{"thought": "I do not know who invented the Brenloom, so I look it up.", "tool": "search",
                "args": {"query": "Brenloom inventor"},
                "result": "Brenloom: The Brenloom is an invention. It was invented by Tessa Varn in 1702."}],
     "thought": "The result says Tessa Varn invented the Brenloom.", "answer": "Tessa Varn", "tool_formats": ["xml"]},
]


def search_examples(tools: list) -> list[dict]:
    """SEARCH_EXAMPLES calling the run's first tool through its first argument (`wiki_search(query=...)`, or
    any search tool of the user's); no examples without a tool."""
    if not tools:
        return []
    name = tools[0].__name__
    first_arg = next(iter(inspect.signature(tools[0]).parameters), "query")
    return [{**example, "steps": [{**step, "tool": name, "args": {first_arg: value for value in step["args"].values()}}
                                  for step in example["steps"]]}
            for example in SEARCH_EXAMPLES]

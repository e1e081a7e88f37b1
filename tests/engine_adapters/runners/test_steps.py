"""The runners' engine surface (:class:`RunnerEngine`), checked without an engine."""

import inspect

import pytest

from promptsplice.engine_adapters import EmbeddedEngine, RemoteEngine, RunnerEngine
from promptsplice.engine_adapters.runners._steps import RAG_SURFACE, check_runner_engine
from promptsplice.errors import ConfigError

SURFACE = ("block_size", "can_relocate", "can_splice", "generate", "generate_phases", "make_assembler")


@pytest.mark.parametrize("cls", [EmbeddedEngine, RemoteEngine])
def test_both_engines_have_the_whole_runner_surface(cls):
    """The Protocol names what the runners use; both engines provide every member
    (looked up statically: a RemoteEngine's properties would ask its server)."""
    members = sorted(n for n in vars(RunnerEngine) if not n.startswith("_"))
    assert tuple(members) == SURFACE
    absent = object()
    assert [n for n in (*SURFACE, *RAG_SURFACE) if inspect.getattr_static(cls, n, absent) is absent] == []


def test_an_engine_without_part_of_the_surface_is_refused_by_name():
    class Partial:
        block_size = 32
        can_splice = can_relocate = False
        generate = generate_phases = make_assembler = staticmethod(lambda *a, **k: None)

    check_runner_engine(Partial(), "AgentRunner")  # AgentRunner never reads kv_store
    with pytest.raises(ConfigError, match=r"got Partial \(without kv_store\)"):
        check_runner_engine(Partial(), "RagRunner", RAG_SURFACE)
    Partial.kv_store = None
    check_runner_engine(Partial(), "RagRunner", RAG_SURFACE)  # the whole surface: accepted
    del Partial.generate_phases
    with pytest.raises(ConfigError, match=r"\(without generate_phases\)"):
        check_runner_engine(Partial(), "AgentRunner")

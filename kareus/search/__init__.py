"""Searchers over a partition's candidate space. Importing this package registers them all."""
from kareus.search import acquisition, surrogate  # noqa: F401  (register passes and surrogates)
from kareus.search import mbo, peers, qnehvi  # noqa: F401  (register searchers; qnehvi imports torch lazily)
from kareus.search.base import SearchProblem, SearchResult, Searcher
from kareus.search.config import (MBOConfig, PassName, SearcherConfig, SurrogateConfig, budget_for, initial_size,
                                  problems)
from kareus.search.space import FreqRange, SpaceConfig, build_space, encode, space_problems

__all__ = ["FreqRange", "MBOConfig", "PassName", "SearchProblem", "SearchResult", "Searcher", "SearcherConfig",
           "SpaceConfig", "SurrogateConfig", "budget_for", "build_space", "encode", "initial_size", "problems",
           "space_problems"]

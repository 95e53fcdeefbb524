"""Where policy parts are found by name: one registry per kind (score, scope, allocation, sparsity).

A part registers itself where it is defined (``@register_score("name")`` on its class), so adding one is adding
one module: every module in ``kvbench/policies/scores/`` (``scopes/``, ``allocations/``) is imported the first time
a name is looked up (``kvbench.registry``). A part defined elsewhere (a notebook, a test, a plug-in) registers when
its module is imported, before the policy that names it is built.
"""

from __future__ import annotations

from kvbench.policies.base import Allocation, Scope, Score
from kvbench.policies.sparse import Sparsity
from kvbench.registry import Registry

SCORES: Registry[type[Score]] = Registry("score", ("kvbench.policies.scores",), Score)
SCOPES: Registry[type[Scope]] = Registry("scope", ("kvbench.policies.scopes",), Scope)
ALLOCATIONS: Registry[type[Allocation]] = Registry("allocation", ("kvbench.policies.allocations",), Allocation)
SPARSITIES: Registry[type[Sparsity]] = Registry("sparsity", ("kvbench.policies.sparsity",), Sparsity)

register_score = SCORES.register
register_scope = SCOPES.register
register_allocation = ALLOCATIONS.register
register_sparsity = SPARSITIES.register

"""KV-cache eviction policies as compositions of parts: score × scope × allocation (+ extras).

Named policies are configs in ``configs/policy/``, one file each naming its parts (``build_policy`` in
``registry.py`` turns one into a ``Policy``): e.g. ``h2o`` is the ``accumulated`` score with a ``sinks_window``
scope, ``pyramidkv`` the ``snapkv`` score with a ``pyramid`` allocation. The parts are found by name in ``parts.py``.

Extras compose with any of them: ``merge: true`` (merge.py) or ``merge: cam`` (cam.py), ``quantize: int8`` (any
quantiser of quantize.py), ``positions: reindex`` (positions.py).

Adding a part is adding a module: a ``Score`` in ``scores/`` registered with ``@register_score("name")`` (it
declares the statistics it ``needs``, its ``history`` if it reads the query log, its ``unsupported_stages``, its
running ``row_sums``), a ``Scope`` in ``scopes/`` (``@register_scope``) or an ``Allocation`` in ``allocations/``
(``@register_allocation``), plus a config naming the parts (docs/extending.md). Every part reads a layer as a
``TokenState`` (``state.py``): dense rows per KV head, padding handled. The statistics are declared one module
each in ``statistics/``, with how each is reduced; they are per KV head, a GQA group's query heads reduced by
their mean.
"""

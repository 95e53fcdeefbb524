"""KV-cache eviction policies as compositions of parts: score × scope × allocation (+ extras).

Named policies are configs in ``configs/policy/`` (``build_policy`` in ``registry.py`` turns one into a
``Policy``)::

    policy              score (scores/)              scope (scopes/)               allocation (allocations/)
    full                none: never evicts           -                             -
    window              recency                      all                           uniform
    streamingllm        recency                      sinks_window (4 sinks)        uniform
    random              random                       all                           uniform
    h2o                 accumulated                  sinks_window (window 0.5 B)   uniform
    scissorhands        hits (history, threshold)    sinks_window (the history)    uniform
    tova                last, shared over heads      sinks_window (none)           uniform
    roco                mean                         robust (ρ 0.1 prefill/0.3 decode) uniform
    snapkv              snapkv (window, pooling)     sinks_window (the window)     uniform
    knorm               key_norm (lower is kept)     sinks_window (none)           uniform
    vatp                value_aware (acc × |v|₁)     sinks_window (4 + 0.5 B)      uniform
    pyramidkv           snapkv                       sinks_window (the window)     pyramid (β 20)
    adakv               snapkv                       sinks_window (the window)     adaptive (floor 0.2)
    mean_window         mean                         sinks_window (as h2o)         uniform      (ablation)
    accumulated_robust  accumulated                  robust (as roco)              uniform      (ablation)

Extras compose with any of them: ``merge: true`` (merge.py), ``quantize: int8|fp8`` (quantize.py),
``positions: reindex`` (positions.py).

Adding a part is adding a module: a ``Score`` in ``scores/`` registered with ``@register_score("name")`` (it
declares the statistics it ``needs``, its ``history`` if it reads the query log, its ``unsupported_stages``, its
running ``row_sums``), a ``Scope`` in ``scopes/`` (``@register_scope``) or an ``Allocation`` in ``allocations/``
(``@register_allocation``), plus a config naming the parts (docs/extending.md). Every part reads a layer as a
``TokenState`` (``state.py``): dense rows per KV head, padding handled. The statistics are declared one module
each in ``statistics/``, with how each is reduced; they are per KV head, a GQA group's query heads reduced by
their mean.
"""

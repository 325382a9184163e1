"""Which trainer weight feeds which inference tensor: names through `name_map`, and tied weights.

A tie is one tensor under several names on one side, declared by that side alone (`Refit.add_source(...,
aliases=...)`, `Refit.add_destination(..., aliases=...)`); the most common is a tied embedding, where
`lm_head.weight` is `model.embed_tokens.weight`. The four cases of a tied pair `(E, L)` (`L` the alias):

| trainer | engine | what happens |
|---|---|---|
| one tensor (`E`, alias `L`) | one tensor (`E`, alias `L`) | `E` -> `E`, once |
| one tensor (`E`, alias `L`) | two tensors `E`, `L` | `E` -> `E` and `E` -> `L`: one source feeds both |
| two tensors `E`, `L` | one tensor (`E`, alias `L`) | refused, naming both: the engine cannot hold two values |
| two tensors | two tensors | `E` -> `E`, `L` -> `L` (no tie anywhere) |

A trainer that sends only `L` to an engine that ties `L` to `E` writes `E` (the name is an alias of it). Every
other rule is `Refit`'s: a source the map does not cover, a destination nobody maps to, and a mapped name no
destination declares are errors, listed together.

Example (trainer ties, engine does not):
    >>> pairs, errors = match_names(["model.embed_tokens.weight"], ["lm_head.weight", "model.embed_tokens.weight"],
    ...                             src_aliases={"model.embed_tokens.weight": ["lm_head.weight"]})
    >>> pairs, errors
    ([('model.embed_tokens.weight', 'model.embed_tokens.weight'), ('model.embed_tokens.weight', 'lm_head.weight')], [])
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

NameMap = Mapping[str, str] | Callable[[str], "str | None"] | None


def map_name(name_map: NameMap, name: str) -> str | None:
    """`name` through `name_map` (identity when None; None when the map does not cover it)."""
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name)


def merge_aliases(per_rank: Sequence[tuple[int, Mapping[str, Sequence[str]]]], kind: str,
                  errors: list[str]) -> dict[str, str]:
    """alias -> the name it ties to, from every rank's `{name: [aliases]}` of one side (`kind`: "trainer" or
    "inference"); an alias tied to two names, or a name that is both an alias and tied to, is an error."""
    out: dict[str, str] = {}
    where: dict[str, int] = {}
    for rank, aliases in per_rank:
        for name, names in aliases.items():
            for a in names:
                if a == name:
                    continue
                if out.get(a, name) != name:
                    errors.append(f"{kind} tie: {a!r} is tied to {out[a]!r} on rank {where[a]} and to {name!r} on "
                                  f"rank {rank}")
                    continue
                out[a], where[a] = name, rank
    for a, name in sorted(out.items()):
        if name in out:
            errors.append(f"{kind} tie: {a!r} is tied to {name!r}, which is itself tied to {out[name]!r}; tie "
                          "every name to one tensor's name")
    return out


def match_names(
    sources: Collection[str],
    dests: Collection[str],
    *,
    name_map: NameMap = None,
    ignore: Collection[str] = (),
    src_aliases: Mapping[str, Sequence[str]] | None = None,
    dst_aliases: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[tuple[str, str]], list[str]]:
    """Pair trainer weights with the inference global tensors they write.

    Args:
        sources: trainer weight names (every rank's, merged).
        dests: inference global tensor names (the components of every destination).
        name_map: trainer name -> inference name (see `Refit`).
        ignore: trainer names left out on purpose.
        src_aliases, dst_aliases: per side, tensor name -> the other names of the same tensor (`merge_aliases`
            of every rank's declarations gives them).

    Returns:
        `(pairs, errors)`: `(trainer name, inference name)` pairs, each inference name once (a trainer name may feed
        several through its aliases), and the errors (unmapped, extra, duplicate, missing, one-sided ties).
    """
    src_alias = {a: n for n, names in (src_aliases or {}).items() for a in names if a != n}
    dst_alias = {a: n for n, names in (dst_aliases or {}).items() for a in names if a != n}
    dest_set = set(dests)
    pairs: dict[str, str] = {}  # inference name -> trainer name
    via: dict[str, str] = {}  # inference name -> the engine alias a trainer name reached it by
    unmapped, extra, dup, torn = [], [], [], []
    for sname in sorted(sources):
        if sname in ignore:
            continue
        target = map_name(name_map, sname)
        if target is None:
            unmapped.append(sname)
            continue
        reached = target
        if target not in dest_set and target in dst_alias:
            target = dst_alias[target]
        if target not in dest_set:
            extra.append(f"{sname} -> {target}")
        elif target in pairs:
            first, alias = pairs[target], via.get(target) or (reached if reached != target else None)
            if alias is not None:
                torn.append(f"the engine ties {alias!r} to {target!r} (one tensor), but the trainer holds "
                            f"{first!r} and {sname!r} as two weights: tie them in the trainer (one tensor under "
                            "both names) or serve an engine that keeps them apart")
            else:
                dup.append(f"{sname} -> {target}")
        else:
            pairs[target] = sname
            if reached != target:
                via[target] = reached
    # a trainer tie feeds every inference name its aliases reach that nothing else feeds
    for alias, sname in sorted(src_alias.items()):
        if sname in ignore or sname not in sources:
            continue
        target = map_name(name_map, alias)
        if target is None:
            continue
        if target not in dest_set and target in dst_alias:
            target = dst_alias[target]
        if target in dest_set and target not in pairs:
            pairs[target] = sname
    missing = sorted(d for d in dest_set if d not in pairs)
    errors = []
    if unmapped:
        errors.append(f"{len(unmapped)} trainer weights have no inference name (unmapped): {unmapped}")
    if extra:
        errors.append(f"{len(extra)} trainer weights map to names no inference tensor declares (extra): {extra}")
    if dup:
        errors.append(f"{len(dup)} trainer weights map to an inference name already taken (duplicate): {dup}")
    errors.extend(torn)
    if missing:
        errors.append(f"{len(missing)} inference weights have no trainer weight mapped to them (missing): {missing}")
    return sorted(((s, d) for d, s in pairs.items()), key=lambda p: (p[0] != p[1], p)), errors

"""Kernel names: whitespace normalisation, a match blind to known demangler-style differences,
where two names part, and the multiset match of observed names against reference names
(compare.py against torch.profiler, compare_cupti.py against the uprobe launches)."""

import re
from collections import Counter


def norm_name(s):
    """A kernel name with whitespace normalised: runs collapsed, none around punctuation
    (so `foo<int, float>(int*)` and `foo<int,float>(int *)` compare equal)."""
    s = re.sub(r"\s+", " ", str(s)).strip()
    return re.sub(r"\s*([<>(),*&\[\]])\s*", r"\1", s)


_LITERAL_CAST = re.compile(
    r"\((?:unsigned |signed )?(?:char|short|int|long long|long|__int128)\)(-?\d+)")
_LITERAL_SUFFIX = re.compile(r"\b(-?\d+)(?:ull|ul|ll|u|l)\b")
_NESTED_VOID = re.compile(r"(?<=[<,(])void(?=[A-Za-z_(])")


def style_name(s):
    """norm_name, and also blind to two known differences between demanglers (for an
    informational match only): integer template literals, `(unsigned long)1` (cpp_demangle)
    vs `1ul` (c++filt, CUPTI); and the return type of an enclosing function template printed
    before a nested name or a function-template argument (`, void ns::f<...>` vs `, ns::f<...>`)."""
    s = norm_name(s)
    s = _LITERAL_CAST.sub(r"\1", s)
    s = _LITERAL_SUFFIX.sub(r"\1", s)
    return _NESTED_VOID.sub("", s).replace("<void ", "<").replace(",void ", ",")


def divergence(a, b, ctx=28):
    """Where two names part, after normalisation: the common text just before, then each."""
    na, nb = norm_name(a), norm_name(b)
    i = 0
    while i < min(len(na), len(nb)) and na[i] == nb[i]:
        i += 1
    if i >= max(len(na), len(nb)):
        return "identical after normalisation"
    return (f"after `…{na[max(0, i - ctx):i]}` observer has `{na[i:i + ctx]}…`, "
            f"profiler `{nb[i:i + ctx]}…`")


def match_names(observed, reference, key=None):
    """Multiset match of observer kernel names against reference names (normalised by
    `key`, default norm_name). Returns (matched, unmatched observed Counter, unmatched
    reference Counter)."""
    key = key or norm_name
    left = Counter()
    for name, n in reference.items():
        left[key(name)] += n
    shown = {}
    for name in reference:
        shown.setdefault(key(name), name)
    un_obs = Counter()
    matched = 0
    for name, n in observed.items():
        k = key(name)
        m = min(n, left.get(k, 0))
        matched += m
        left[k] -= m
        if n > m:
            un_obs[name] += n - m
    un_ref = Counter({shown[k]: v for k, v in left.items() if v > 0})
    return matched, un_obs, un_ref


def common_prefix(a, b):
    a, b = norm_name(a), norm_name(b)
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i

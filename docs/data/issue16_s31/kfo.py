import timeit
_STR_ONLY = {str}
def old(keys, m, no_nul=False):
    if not keys or {*map(type, keys)} != _STR_ONLY:
        return False
    joined = "".join(keys)
    return (joined.isascii() and "" not in keys and max(map(len, keys)) <= m and not (no_nul and "\x00" in joined))
def new(keys, m, no_nul=False):
    if not keys or {*map(type, keys)} != _STR_ONLY:
        return False
    joined = "".join(keys)
    return (joined.isascii() and "" not in keys
            and (len(joined) <= m or max(map(len, keys)) <= m)
            and not (no_nul and "\x00" in joined))
g = [f"meta-key-{i}" for i in range(16)]
for f in (old, new, old, new):
    print(f.__name__, min(timeit.repeat(lambda: f(g, 4096, True), number=100000, repeat=5)) * 10, "us")

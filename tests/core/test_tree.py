"""Pytree flatten/unflatten and the structure-keyed compile wrapper."""

import attrs
import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_engine.core.tree import CompiledFunction, static_field, tree_flatten, tree_map, tree_unflatten


@attrs.frozen
class Inner:
    a: mx.array
    n: int = static_field(default=3)


@attrs.frozen
class Outer:
    xs: tuple
    inner: Inner
    maybe: mx.array | None = None
    tag: str = static_field(default="t")


def _arrays(draw, n):
    return [mx.array(draw(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=4))) for _ in range(n)]


@st.composite
def trees(draw, depth=0):
    kind = draw(st.sampled_from(["leaf", "list", "tuple", "dict", "attrs", "none"] if depth < 3 else ["leaf"]))
    if kind == "leaf":
        return _arrays(draw, 1)[0]
    if kind == "none":
        return None
    if kind in ("list", "tuple"):
        items = [draw(trees(depth + 1)) for _ in range(draw(st.integers(0, 3)))]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        keys = draw(st.lists(st.text("abc", min_size=1, max_size=3), max_size=3, unique=True))
        return {k: draw(trees(depth + 1)) for k in keys}
    return Outer(
        xs=tuple(draw(trees(depth + 1)) for _ in range(draw(st.integers(0, 2)))),
        inner=Inner(a=_arrays(draw, 1)[0], n=draw(st.integers(0, 5))),
        maybe=draw(st.one_of(st.none(), st.just(mx.array([1.0])))),
        tag=draw(st.text("xyz", max_size=2)),
    )


def _same(a, b):
    if isinstance(a, mx.array):
        return isinstance(b, mx.array) and a.shape == b.shape and bool(mx.array_equal(a, b))
    if attrs.has(type(a)):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a))
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=60, deadline=None)
@given(trees())
def test_flatten_unflatten_round_trip(tree):
    leaves, td = tree_flatten(tree)
    assert all(isinstance(x, mx.array) for x in leaves)
    assert _same(tree_unflatten(td, leaves), tree)
    hash(td)  # treedefs are hashable (they key the compile cache)


@settings(max_examples=30, deadline=None)
@given(trees(), trees())
def test_treedef_equal_iff_structure_equal(a, b):
    la, ta = tree_flatten(a)
    lb, tb = tree_flatten(b)
    if ta == tb:
        assert len(la) == len(lb)
        # Rebuilding b's leaves into a's structure yields b when the structures are equal.
        assert _same(tree_unflatten(ta, lb), b)


def test_static_fields_are_not_leaves():
    leaves, td = tree_flatten(Inner(a=mx.array([1.0]), n=7))
    assert len(leaves) == 1
    assert tree_unflatten(td, leaves).n == 7


@attrs.frozen
class Spec:
    dims: tuple = static_field()


def test_static_values_key_by_value_whatever_their_container() -> None:
    """Static values are keyed by value: a tuple of scalars or attrs instances as it is, a
    list (or a tuple holding one) as the equal tuple; an equal structure gives an equal,
    equally hashed key (a hit), a different one another key."""
    keys = [tree_flatten(Spec(dims=d))[1] for d in
            [(1, 2), [1, 2], (1, [2]), (1, (2,)), ((1, 2),), (Spec((1,)), 2), (Spec((1,)), 2)]]
    assert keys[0] == keys[1] and hash(keys[0]) == hash(keys[1])
    assert keys[2] == keys[3] != keys[0] and hash(keys[2]) == hash(keys[3])
    assert keys[4] != keys[0] and keys[5] == keys[6] and hash(keys[5]) == hash(keys[6])
    f = CompiledFunction(lambda s, x: x * len(s.dims))
    assert f(Spec((1, 2)), mx.array(1.0)).item() == 2 and f(Spec([1, 2]), mx.array(1.0)).item() == 2
    assert f.traces == 1
    assert f(Spec((1, 2, 3)), mx.array(1.0)).item() == 3 and f.traces == 2


def test_rebuilt_static_specs_hash_like_constructed_ones() -> None:
    """A cache's LayerSpec rebuilt by tree_unflatten / tree_replace (object.__new__, fields
    set directly) hashes and compares like one built by its constructor (it is part of
    every compile key)."""
    from fx_engine.core.cache import LayerSpec
    from fx_engine.core.tree import tree_replace

    s = LayerSpec(kv_heads=3, head_dim=64)
    leaves, td = tree_flatten(s)
    r = tree_unflatten(td, leaves)
    assert r == s and hash(r) == hash(s)
    t = tree_replace(s, ring=8)
    assert hash(t) == hash(LayerSpec(kv_heads=3, head_dim=64, ring=8)) and t != s


def test_tree_map():
    t = Outer(xs=(mx.array([1.0]),), inner=Inner(a=mx.array([2.0])))
    out = tree_map(lambda x: x * 10, t)
    assert out.xs[0].item() == 10 and out.inner.a.item() == 20 and out.tag == "t"


def test_unsupported_node_is_a_clear_error():
    with pytest.raises(TypeError, match="unsupported node"):
        tree_flatten({"a": object()})


def weighted(t):
    # Weights elements by position: different structures must give different results.
    xs, rest = t[0], t[1:]
    total = mx.array(0.0)
    for i, x in enumerate(xs):
        total = total + (i + 1) * x
    for x in rest:
        total = total + 1000 * x
    return total


def test_structure_collision_is_impossible():
    """MLX's own compile key ignores container lengths: g(([1,2],3)) and g(([1],2,3)) share
    an entry and the second returns a wrong result. Our wrapper must not."""
    a = (([mx.array(1.0), mx.array(2.0)], mx.array(3.0)))
    b = (([mx.array(1.0)], mx.array(2.0), mx.array(3.0)))
    eager_a, eager_b = weighted(a).item(), weighted(b).item()
    assert eager_a != eager_b
    f = CompiledFunction(weighted)
    assert f(a).item() == eager_a
    assert f(b).item() == eager_b
    assert f.structures() == 2
    # list vs tuple with the same leaves: distinct entries too
    c = ((mx.array(1.0), mx.array(2.0)), mx.array(3.0))
    assert f(c).item() == eager_a
    assert f.structures() == 3


def test_static_field_change_retraces_and_array_change_does_not():
    f = CompiledFunction(lambda t: t.a * t.n)
    assert f(Inner(a=mx.array([2.0]), n=3)).item() == 6
    assert f(Inner(a=mx.array([5.0]), n=3)).item() == 15
    assert f.traces == 1
    assert f(Inner(a=mx.array([5.0]), n=4)).item() == 20
    assert f.traces == 2


def test_compiled_returns_attrs_objects():
    f = CompiledFunction(lambda t: Inner(a=t.a + 1, n=t.n))
    out = f(Inner(a=mx.array([1.0]), n=9))
    mx.eval(out.a)
    assert isinstance(out, Inner) and out.n == 9 and out.a.item() == 2.0


@attrs.frozen
class Memo:
    __fx_memo_flatten__ = True
    a: mx.array
    n: int = static_field(default=1)


def test_memoized_flatten_is_per_object():
    m1, m2 = Memo(a=mx.array([1.0])), Memo(a=mx.array([2.0]), n=2)
    for _ in range(2):
        l1, t1 = tree_flatten([m1, m2])
        assert [x.item() for x in l1] == [1.0, 2.0]
        assert tree_unflatten(t1, l1)[1].n == 2
    f = CompiledFunction(lambda t: t.a * t.n)
    assert f(m1).item() == 1.0 and f(m2).item() == 4.0


def test_output_structure_that_depends_on_shapes():
    """A Python value computed from a shape is part of the output: never stale."""
    f = CompiledFunction(lambda x: (x * 2, x.shape[0]))
    assert f(mx.zeros((3,)))[1] == 3
    assert f(mx.zeros((5,)))[1] == 5
    assert f(mx.zeros((3,)))[1] == 3  # MLX reuses the first trace; our output def too


def test_compile_key_is_the_bound_signature() -> None:
    """Issue 43 item 4: equal calls share one trace, however they are spelled: an omitted
    argument and its default passed explicitly, by position or by keyword."""
    import mlx.core as mx

    from fx_engine.core.tree import CompiledFunction, bound_arguments

    def f(x, y=None, *, scale=2.0):  # noqa: ANN001, ANN202
        return x * scale if y is None else x + y

    cf = CompiledFunction(f)
    x = mx.ones((3,))
    for call in (lambda: cf(x), lambda: cf(x, None), lambda: cf(x, y=None), lambda: cf(x=x),
                 lambda: cf(x, scale=2.0)):
        assert mx.array_equal(call(), x * 2)
    assert cf.traces == 1, cf.trace_log
    assert mx.array_equal(cf(x, x), x + x) and cf.traces == 2  # a different call: a new trace
    # calls that do not bind are left alone, and the function raises as usual
    assert bound_arguments(f, (), {}) == ((), {})
    assert bound_arguments(f, (x,), {"z": 1}) == ((x,), {"z": 1})
    try:
        cf(x, z=1)
    except TypeError as e:
        assert "z" in str(e)
    else:
        raise AssertionError("an unknown keyword must raise")


def test_decode_step_with_and_without_mask_share_one_trace(default_model) -> None:  # noqa: ANN001
    """decode_step_compiled(p, cache, state) and (..., mask=None) are one compiled call."""
    import mlx.core as mx

    import fx_engine

    m = default_model
    ids = m.tokenizer.encode("Hello")
    _, cache, state = fx_engine.prefill(m, [ids], room=8)
    before = fx_engine.decode_step_compiled.traces
    s1, c1 = fx_engine.decode_step_compiled(m.params, cache, state)
    mx.eval(s1.tokens)
    mid = fx_engine.decode_step_compiled.traces
    s2, c2 = fx_engine.decode_step_compiled(m.params, cache, state, None, mask=None)
    mx.eval(s2.tokens)
    assert fx_engine.decode_step_compiled.traces == mid <= before + 1
    assert s1.tokens.tolist() == s2.tokens.tolist()

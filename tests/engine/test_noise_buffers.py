"""Noise laws drawn into reused buffers give the same bits as a fresh out-of-place draw.

The reference samplers below are the plain out-of-place formulas (every temporary a fresh tensor),
as the laws were written before they drew into ``out=`` buffers and workspaces; the stream is
checked against the reference block by block (block ``b`` seeded by ``mix_seed(seed, b)``), for
every built-in law, several shapes (including tensors past torch's parallel grain), both float
dtypes, one and two threads, and chunk sizes that straddle blocks.
"""

from __future__ import annotations

import gc

import pytest
import torch

from mcgraph.engine.noise import laws as nz, streams
from mcgraph.engine.noise.streams import BlockStream, Workspace, mix_seed, seeded


# --------------------------------------------------------------------------- reference samplers


def _uniform_open(shape, dtype, device):
    finfo = torch.finfo(dtype)
    return torch.rand(shape, dtype=dtype, device=device).clamp_(finfo.tiny, 1.0 - finfo.eps)


def _exponential(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device).exponential_()


def _standard_gamma(concentration, shape, dtype, device):
    alpha = concentration.detach().to(dtype=dtype, device=device).expand(shape).contiguous()
    return torch._standard_gamma(alpha).clamp_(min=torch.finfo(dtype).tiny)


def ref_laplace(shape, dtype, device):
    finfo = torch.finfo(dtype)
    u = torch.rand(shape, dtype=dtype, device=device) * 2 - 1
    u = u.clamp_(-1 + finfo.eps, 1 - finfo.eps)
    return -u.sign() * torch.log1p(-u.abs())


def ref_logistic(shape, dtype, device):
    u = _uniform_open(shape, dtype, device)
    return u.log() - torch.log1p(-u)


def ref_radial(event_ndims):
    def sampler(shape, dtype, device):
        eps = torch.randn(shape, dtype=dtype, device=device)
        dims = tuple(range(len(shape) - event_ndims, len(shape)))
        r_shape = shape[: len(shape) - event_ndims] + (1,) * event_ndims
        r = torch.randn(r_shape, dtype=dtype, device=device)
        norm = eps.square().sum(dim=dims, keepdim=True).sqrt() if dims else eps.abs()
        return eps / norm * r
    return sampler


def ref_student_t(df):
    def sampler(shape, dtype, device):
        nu = df.detach().to(dtype=dtype, device=device)
        z = torch.randn(shape, dtype=dtype, device=device)
        chi2 = 2 * _standard_gamma(nu / 2, shape, dtype, device)
        return z * torch.rsqrt(chi2 / nu)
    return sampler


def ref_weibull(k):
    def sampler(shape, dtype, device):
        kk = k.detach().to(dtype=dtype, device=device)
        return _exponential(shape, dtype, device).pow_(kk.reciprocal().expand(shape))
    return sampler


CONC = torch.tensor(2.5)
DF = torch.tensor(4.0)

# (name, law, reference sampler, event_ndims)
LAWS = [
    ("normal", nz.STANDARD_NORMAL, lambda s, d, dev: torch.randn(s, dtype=d, device=dev), 0),
    ("laplace", nz.STANDARD_LAPLACE, ref_laplace, 0),
    ("logistic", nz.STANDARD_LOGISTIC, ref_logistic, 0),
    ("cauchy", nz.STANDARD_CAUCHY, lambda s, d, dev: torch.empty(s, dtype=d, device=dev).cauchy_(), 0),
    ("gumbel", nz.STANDARD_GUMBEL, lambda s, d, dev: -torch.log(-torch.log(_uniform_open(s, d, dev))), 0),
    ("uniform", nz.STANDARD_UNIFORM, lambda s, d, dev: torch.rand(s, dtype=d, device=dev), 0),
    ("exponential", nz.STANDARD_EXPONENTIAL, _exponential, 0),
    ("half_normal", nz.STANDARD_HALF_NORMAL, lambda s, d, dev: torch.randn(s, dtype=d, device=dev).abs_(), 0),
    ("half_cauchy", nz.STANDARD_HALF_CAUCHY,
     lambda s, d, dev: torch.empty(s, dtype=d, device=dev).cauchy_().abs_(), 0),
    ("rayleigh", nz.STANDARD_RAYLEIGH, lambda s, d, dev: torch.sqrt(2 * _exponential(s, d, dev)), 0),
    ("gamma", nz.gamma_noise(CONC), lambda s, d, dev: _standard_gamma(CONC, s, d, dev), 0),
    ("inverse_gamma", nz.inverse_gamma_noise(CONC),
     lambda s, d, dev: _standard_gamma(CONC, s, d, dev).reciprocal_(), 0),
    ("weibull", nz.weibull_noise(CONC), ref_weibull(CONC), 0),
    ("student_t", nz.student_t_noise(DF), ref_student_t(DF), 0),
    ("radial0", nz.radial_noise_law(0), ref_radial(0), 0),
    ("radial1", nz.radial_noise_law(1), ref_radial(1), 1),
    ("radial2", nz.radial_noise_law(2), ref_radial(2), 2),
]
IDS = [name for name, *_ in LAWS]

# noise shapes of one sample: small, odd-sized, and past torch's parallel grain (32768 elements)
SHAPES = [(3,), (5, 7), (41, 1000)]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _reference_stream(ref, shape, dtype, seed, num_samples, block):
    parts = []
    for b, start in enumerate(range(0, num_samples, block)):
        n = min(block, num_samples - start)
        with seeded(mix_seed(seed, b), torch.device("cpu")):
            parts.append(ref((n,) + shape, dtype, torch.device("cpu")))
    return torch.cat(parts)


def _stream(law, shape, dtype, seed, num_samples, block, owns_rows=False):
    def draw(n, out=None, work=None):
        return law.sample((n,) + shape, dtype, torch.device("cpu"), out=out, work=work)
    return BlockStream(draw, num_samples, block, seed, torch.device("cpu"), owns_rows=owns_rows,
                       fills_out=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,law,ref,event_ndims", LAWS, ids=IDS)
def test_law_into_buffers_matches_fresh_reference(name, law, ref, event_ndims, shape, dtype, threads):
    if event_ndims > len(shape):
        pytest.skip("event wider than the sample")
    full = (4,) + shape
    with seeded(123, torch.device("cpu")):
        expected = ref(full, dtype, torch.device("cpu"))
    # fresh (no out, no workspace), into a dirty out buffer with a dirty workspace, and a second
    # time into the same buffers (stale contents must not leak into the draw)
    work = Workspace()
    for _ in range(2):
        with seeded(123, torch.device("cpu")):
            fresh = law.sample(full, dtype, torch.device("cpu"))
        out = torch.full(full, float("nan"), dtype=dtype)
        with seeded(123, torch.device("cpu")):
            got = law.sample(full, dtype, torch.device("cpu"), out=out, work=work)
        assert torch.equal(fresh, expected), name
        assert torch.equal(got, expected), name
        for buf in work._buffers.values():
            buf.fill_(float("nan"))


@pytest.mark.parametrize("owns_rows", [False, True], ids=["views", "owned"])
@pytest.mark.parametrize("name,law,ref,event_ndims", LAWS, ids=IDS)
def test_stream_with_reused_block_matches_reference(name, law, ref, event_ndims, owns_rows, threads):
    shape, dtype, seed, num_samples, block = (9, 13), torch.float32, 7, 23, 5  # last block partial
    expected = _reference_stream(ref, shape, dtype, seed, num_samples, block)
    for chunk in (1, 3, 5, 7, 23):
        stream = _stream(law, shape, dtype, seed, num_samples, block, owns_rows)
        got = [rows.clone() for _, _, rows in stream.chunks(chunk)]
        assert torch.equal(torch.cat(got), expected), (name, chunk)


def test_owned_stream_draws_every_block_into_one_buffer():
    stream = _stream(nz.radial_noise_law(2), (64, 32), torch.float32, 0, 50, 8, owns_rows=True)
    pointers = set()
    for _, _, rows in stream.chunks(8):
        pointers.add(rows.data_ptr())
    assert len(pointers) == 1  # seven blocks (the last one partial), one memory block


def test_view_stream_reuses_its_buffer_only_once_every_view_is_gone():
    law, shape = nz.STANDARD_LAPLACE, (4, 6)
    expected = _reference_stream(ref_laplace, shape, torch.float32, 3, 12, 4)
    stream = _stream(law, shape, torch.float32, 3, 12, 4)
    first = stream.rows(0, 4)
    kept = first[1:3]  # a view still alive: the next block must not overwrite it
    second = stream.rows(4, 8)
    assert torch.equal(kept, expected[1:3]) and torch.equal(second, expected[4:8])
    assert second.data_ptr() != first.data_ptr()
    ptr = second.data_ptr()
    del first, kept, second
    gc.collect()
    third = stream.rows(8, 12)
    assert third.data_ptr() == ptr and torch.equal(third, expected[8:12])


def test_straddling_rows_are_one_copy_of_both_blocks():
    expected = _reference_stream(lambda s, d, dev: torch.randn(s, dtype=d, device=dev), (3,), torch.float32,
                                 5, 10, 4)
    stream = _stream(nz.STANDARD_NORMAL, (3,), torch.float32, 5, 10, 4)
    assert torch.equal(stream.rows(2, 10), expected[2:10])
    assert torch.equal(stream.rows(3, 6), expected[3:6])


def test_workspace_grows_and_reuses():
    work = Workspace()
    a = work.buffer("x", (3, 4), torch.float32, "cpu")
    b = work.buffer("x", (2, 2), torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr() and work.nbytes() == 48
    c = work.buffer("x", (5, 4), torch.float32, "cpu")
    assert c.shape == (5, 4) and work.nbytes() == 80
    d = work.buffer("x", (2,), torch.float64, "cpu")
    assert d.dtype == torch.float64


@pytest.mark.parametrize("full,event_ndims", [
    ((1, 300, 1000), 2),   # one event (torch reduces it in parallel pieces)
    ((3, 300, 1000), 2),   # few events: torch's split of the outputs across threads matters
    ((5, 300, 1000), 2),
    ((2, 3, 100_000), 1),  # batch dims in front of the event
    ((7, 5, 9), 2),
    ((9, 4), 1),
])
def test_radial_norms_into_workspace_match_one_shot_norms(full, event_ndims, threads):
    law, ref = nz.radial_noise_law(event_ndims), ref_radial(event_ndims)
    with seeded(11, torch.device("cpu")):
        expected = ref(full, torch.float32, torch.device("cpu"))
    with seeded(11, torch.device("cpu")):
        got = law.sample(full, torch.float32, torch.device("cpu"), out=torch.empty(full), work=Workspace())
    assert torch.equal(got, expected)


def _owned_normal_stream(seed, shape=(6, 5), num_samples=10, block=4):
    stream = _stream(nz.STANDARD_NORMAL, shape, torch.float32, seed, num_samples, block, owns_rows=True)
    stream.row_shape, stream.dtype = shape, torch.float32
    return stream


def test_pool_hands_a_finished_stream_block_to_the_next_stream():
    ref = lambda s, d, dev: torch.randn(s, dtype=d, device=dev)  # noqa: E731
    with streams.reuse_noise_blocks() as pool:
        first = _owned_normal_stream(1)
        rows = [r.clone() for _, _, r in first.chunks(4)]
        ptr = first._buffer.data_ptr()
        first.release()
        assert pool.nbytes() >= 4 * 30 * 4
        second = _owned_normal_stream(2)
        got = []
        for _, _, r in second.chunks(4):
            assert r.data_ptr() == ptr
            got.append(r.clone())
        assert second._work is first._work is pool.workspace
    assert torch.equal(torch.cat(rows), _reference_stream(ref, (6, 5), torch.float32, 1, 10, 4))
    assert torch.equal(torch.cat(got), _reference_stream(ref, (6, 5), torch.float32, 2, 10, 4))


def test_pool_does_not_take_a_block_that_a_view_still_holds():
    with streams.reuse_noise_blocks() as pool:
        stream = _owned_normal_stream(1)
        kept = stream.rows(0, 4)[1:2]
        stream.release()
        assert pool.nbytes() == 0  # kept still reads the block: it is not handed on
        expected = kept.clone()
        other = _owned_normal_stream(2)
        other.rows(0, 4)
        assert torch.equal(kept, expected)
    outside = _owned_normal_stream(1)
    outside.rows(0, 4)
    outside.release()
    assert outside._buffer is None and streams._POOL.get() is None


def test_straddling_rows_that_carry_a_graph_keep_it():
    scale = torch.tensor(2.0, requires_grad=True)

    def draw(n):  # rsample-like rows: a function of a parameter
        return torch.randn(n, 3) * scale

    stream = BlockStream(draw, 10, 4, 5, torch.device("cpu"))
    rows = stream.rows(2, 10)
    rows.sum().backward()
    expected = _reference_stream(lambda s, d, dev: torch.randn(s, dtype=d, device=dev), (3,), torch.float32,
                                 5, 10, 4)[2:10]
    assert torch.equal(rows.detach(), 2 * expected)
    assert torch.allclose(scale.grad, expected.sum())


def test_consumer_loop_over_view_chunks_redraws_each_block_in_place():
    ref = lambda s, d, dev: torch.randn(s, dtype=d, device=dev)  # noqa: E731
    stream = _stream(nz.STANDARD_NORMAL, (6, 5), torch.float32, 3, 20, 4)  # rows are views, not owned
    first_rows, got = set(), []
    for start, _, rows in stream.chunks(2):  # the loop holds the last chunk while asking for the next
        got.append(rows.clone())
        if start % 4 == 0:
            first_rows.add(rows.data_ptr())
    assert len(first_rows) == 1  # five blocks, one memory block: the last chunk of each was a copy
    assert torch.equal(torch.cat(got), _reference_stream(ref, (6, 5), torch.float32, 3, 20, 4))

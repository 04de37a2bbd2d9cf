"""Does overlord's cost model predict measured GPU step time? One row at a time, then a balance.

What is measured: forward plus backward of a stack of ``--layers`` transformer
blocks of a 7B-like dense model (hidden 4096, 32 heads of 128, SwiGLU MLP of
11008, RMSNorm, no rotary; bf16 on CUDA) on one packed row of ``T =
max_seq_len`` tokens: input random activations ``[1, T, 4096]`` that require
grad, loss ``out.float().square().mean()``, then ``backward()``. Attention is
causal and document-masked: each document of the row attends only to itself,
as a trainer does with ``cu_seqlens``. Attention, by ``--attn`` (``auto``
takes the first that works, checked against ``sdpa-loop`` on a small row):

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention on
  ``cu_seqlens``), where the installed torch has it: what trainers use;
- ``flex``: ``flex_attention`` under ``torch.compile`` with a block mask that
  is causal and same-document (built before timing, once per row);
- ``sdpa-loop``: ``scaled_dot_product_attention(is_causal=True)`` per
  document slice (exact, but a Python loop; the CPU path).

It imports ``overlord.plan`` (numpy and pydantic). On a GPU machine that has
torch but not pydantic, carry its wheels and put them on the path first, e.g.
``pip download --no-deps --only-binary=:all: -d .whl pydantic==2.14.4
pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions``
(for that machine's Python and platform), then ``pip install --no-deps
--target /tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site:. python3 -m
benchmarks.cost_fit``.

Each time is the median of ``--reps`` repetitions timed with CUDA events
(``perf_counter`` on CPU), after warm-up (more for the first row of a shape,
where ``torch.compile`` runs).

The rows: for each context, a ladder of rows of equal documents (one document
of the whole row, two halves, ... down to 128 tokens), a row of 32-token
documents, and rows drawn from the long-tailed sources of
``benchmarks/_lib/synthetic.py`` (the mixture by token share, and web, code and
papers alone), documents split at the context as ``long_docs: split`` does,
packed in order, the last one cut to fit. So every row holds exactly T tokens
(S1 = sum L = T) and S2 = sum L**2 spans T*32 .. T**2. (Attention kernels work
in tiles of 64-128 tokens, so documents shorter than a tile cost more than
their L**2: the 32-token rows show how much.)

The model under test (``overlord/plan/cost.py``): a document of L tokens costs
``alpha * L + beta * L**2`` with ``alpha = 6 * params`` and ``beta = 6 *
layers * hidden``; here params is the parameter count of the measured block
stack, so a row costs ``alpha * S1 + beta * S2``. Fits, over all contexts
together (S1 is constant within a context):

(a) overlord's model with one free scale, ``t = k * (alpha*S1 + beta*S2)``
    (k by least squares on relative error); R^2, mean and max absolute
    percentage error, overall and per context; ``1 / k`` is the model FLOP/s
    achieved. Per context, a free line ``t = u + v * S2`` gives the measured
    weight of attention against the model's: ``(v * S1 / u) / (beta / alpha)``
    (1 when overlord's beta/alpha is right; the fixed overhead lowers it).
(b) a free ``t = a*S1 + b*S2 + c``, fitted by ``overlord.plan.cost.fit_cost``
    (``CostModel.fit``; least squares on relative error; c only with two or
    more token counts): R^2,
    ``b / a`` against overlord's ``beta / alpha``, and the fixed overhead c.
    Flash attention does about 7 L**2 * hidden FLOPs per layer forward and
    backward with recomputation against the model's 6, at a lower FLOP rate
    than the matmuls, so b/a above beta/alpha is expected.

(c) End to end: ``--balance-steps`` steps of ``--balance-dp`` ranks x
``--balance-rpr`` rows at each ``--balance-contexts`` context, from overlord's
own reference packing (``select_step`` over the synthetic sources, as
``benchmarks/balance_e2e.py``), assigned with ``overlord.plan.balance.assign``
by ``kk`` and by ``none`` (the baseline), with overlord's cost model of the
measured stack. Every row is measured: at its own length (a varlen trainer,
whose padding costs nothing, as the model assumes), or with ``flex``, which is
compiled per length, padded to T with 64-token padding documents. A rank's
time is the sum of its rows; the measured speed-up (max rank, none / kk) is set
next to the model's predicted one and to the one fit (b) predicts, and each
rank's measured time against overlord's model scaled by fit (a)'s k.

Run from the repository root (GPU: a few minutes; ``--budget-s``, counted from
after the imports, stops measuring new rows in time and still writes
everything; the balance steps are measured after a third of the fit rows)::

    python -m benchmarks.cost_fit --out /tmp/cost_fit
    python -m benchmarks.cost_fit --quick --device cpu   # plumbing only, under a minute

Writes ``cost_fit.json``, ``cost_fit.md`` (every row) and ``cost_fit.png``
(measured against predicted) into ``--out`` (default ``$OUT``, else
``benchmarks/``); prints the summary tables last.
"""

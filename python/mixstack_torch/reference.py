"""Eager PyTorch reference of the SO(2) mixing stack (docs/MIXING_STACK.md).

Written from the document, not from the kernels: it is the in-framework
reference the op is tested against.

- :func:`forward`: the forward pass in plain torch ops (batched over F with
  ``torch.bmm``); differentiable, so autograd of it is one backward reference.
- :func:`backward`: the closed-form input-gradient backward of the document,
  a second, independent reference (and the one that matches the kernels'
  ``grad_alpha = sum(g * out) / max(alpha, 1e-12)``).

Shapes (row-major): u0 (F, E, ROW), alpha (E, F), w0_all (n_layers, F, M0, M0),
w1_all (n_layers, F, M1, M1), gw_all (n_layers-1, F, Cf, LG); returns
out (E, F, ROW), z_all (n_layers-1, F, E, ROW). ROW = (3L+1)Cf,
M0 = (L+1)Cf, M1 = 2L*Cf, LG = L*Cf.
"""

import torch


def dims(lmax, focus_dim):
    """(ROW, M0, M1, LG) for lmax L and focus dim Cf."""
    cf, L = int(focus_dim), int(lmax)
    return (3 * L + 1) * cf, (L + 1) * cf, 2 * L * cf, L * cf


def _silu(s):
    return s * torch.sigmoid(s)


def forward(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha):
    """Eager forward. Returns (out (E, F, ROW), z_all (n_layers-1, F, E, ROW)).

    Differentiable w.r.t. every tensor argument (autograd gives the
    reference backward).
    """
    F, E, ROW = u0.shape
    cf = int(focus_dim)
    row, m0, _m1, _lg = dims(lmax, cf)
    assert ROW == row, f"u0 rows {ROW} != (3*lmax+1)*Cf = {row}"
    n_layers = w0_all.shape[0]
    u = u0
    zs = []
    for k in range(n_layers - 1):
        z0 = torch.bmm(u[..., :m0], w0_all[k])  # (F, E, M0)
        z1 = torch.bmm(u[..., m0:], w1_all[k])  # (F, E, M1)
        s = z0[..., :cf]  # scalar slice
        sig = torch.sigmoid(torch.bmm(s, gw_all[k]))  # (F, E, LG), group g = cols g*Cf..
        act = torch.cat([_silu(s), z0[..., cf:] * sig, z1 * torch.cat([sig, sig], dim=-1)], dim=-1)
        u = u + act  # residual
        zs.append(torch.cat([z0, z1], dim=-1))
    last = n_layers - 1
    v = u + torch.cat([torch.bmm(u[..., :m0], w0_all[last]), torch.bmm(u[..., m0:], w1_all[last])], dim=-1)
    if apply_alpha:
        v = v * alpha.t().unsqueeze(-1)  # alpha (E, F) -> (F, E, 1)
    out = v.transpose(0, 1).contiguous()  # (E, F, ROW), edge-major
    if zs:
        z_all = torch.stack(zs, dim=0)
    else:
        z_all = u0.new_zeros((0, F, E, ROW))
    return out, z_all


def backward(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha):
    """Closed-form input-gradient backward of docs/MIXING_STACK.md.

    grad_out, out: (E, F, ROW); z_all: (n_layers-1, F, E, ROW); alpha: (E, F).
    Returns (grad_u0 (F, E, ROW), grad_alpha (E, F)); grad_alpha is zeros
    when not apply_alpha. No weight gradients.
    """
    cf = int(focus_dim)
    _row, m0, _m1, lg = dims(lmax, cf)
    n_layers = w0_all.shape[0]
    g = grad_out.transpose(0, 1)  # (F, E, ROW)
    if apply_alpha:
        a = alpha.t()  # (F, E)
        o = out.transpose(0, 1)
        grad_alpha = ((g * o).sum(dim=-1) / a.clamp_min(1e-12)).t().contiguous()
        g = g * a.unsqueeze(-1)
    else:
        grad_alpha = torch.zeros_like(alpha)
    last = n_layers - 1
    g = g + torch.cat(
        [
            torch.bmm(g[..., :m0], w0_all[last].transpose(1, 2)),
            torch.bmm(g[..., m0:], w1_all[last].transpose(1, 2)),
        ],
        dim=-1,
    )
    for k in range(n_layers - 2, -1, -1):
        z = z_all[k]
        s = z[..., :cf]
        sig = torch.sigmoid(torch.bmm(s, gw_all[k]))  # recompute, (F, E, LG)
        s0 = torch.sigmoid(s)
        gz_s = g[..., :cf] * s0 * (1 + s * (1 - s0))  # silu'
        # The three gated subtile groups: (m=0, l>=1), (m=-1), (m=+1), each LG wide.
        g_a, g_b, g_c = g[..., cf:m0], g[..., m0 : m0 + lg], g[..., m0 + lg :]
        z_a, z_b, z_c = z[..., cf:m0], z[..., m0 : m0 + lg], z[..., m0 + lg :]
        g_sig = g_a * z_a + g_b * z_b + g_c * z_c
        g_logit = g_sig * sig * (1 - sig)
        gz_s = gz_s + torch.bmm(g_logit, gw_all[k].transpose(1, 2))  # gate path
        gz = torch.cat([gz_s, g_a * sig, g_b * sig, g_c * sig], dim=-1)
        g = g + torch.cat(
            [
                torch.bmm(gz[..., :m0], w0_all[k].transpose(1, 2)),
                torch.bmm(gz[..., m0:], w1_all[k].transpose(1, 2)),
            ],
            dim=-1,
        )
    return g.contiguous(), grad_alpha


def autograd_backward(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, grad_out):
    """Backward reference by autograd of :func:`forward`: (grad_u0, grad_alpha)."""
    with torch.enable_grad():
        u = u0.detach().requires_grad_(True)
        a = alpha.detach().requires_grad_(True)
        out, _ = forward(u, a, w0_all.detach(), w1_all.detach(), gw_all.detach(), lmax, focus_dim, apply_alpha)
        gu, ga = torch.autograd.grad(out, (u, a), grad_out, allow_unused=True)
    if ga is None:
        ga = torch.zeros_like(alpha)
    return gu, ga

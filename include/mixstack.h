/*
 * mixstack.h -- C ABI of mixstack, the SO(2) mixing stack of the SeZM / DPA4
 * descriptor (forward and input-gradient backward) on CUDA.
 *
 * Library: libmixstack.so (cargo build --release -> target/release/).
 * Implementation: src/capi/ (entry.rs). Math and layouts: docs/MIXING_STACK.md.
 *
 * Shapes (all tensors dense, row-major, contiguous, device memory of the
 * stack's device, element type of the stack: float (f32) or double (f64)):
 *   ROW = (3*lmax+1)*Cf, M0 = (lmax+1)*Cf, M1 = 2*lmax*Cf, LG = lmax*Cf
 *   u0         (F, E, ROW)              focus-major input
 *   alpha      (E, F)                   competition weight
 *   w0         (n_layers, F, M0, M0)    m = 0 weights, (in, out)
 *   w1         (n_layers, F, M1, M1)    |m| = 1 weights, (in, out)
 *   gw         (n_layers-1, F, Cf, LG)  gate projections, (in, out)
 *   out        (E, F, ROW)              edge-major output
 *   z_all      (n_layers-1, F, E, ROW)  saved pre-activations of the gated layers
 *   grad_out   (E, F, ROW)
 *   grad_u0    (F, E, ROW)
 *   grad_alpha (E, F)                   zeros when apply_alpha == 0
 *
 * Conventions:
 *   - Every function returns a mixstack_status (as int) except where noted;
 *     on failure mixstack_last_error() describes it. Arguments are checked
 *     before anything is launched: a failing call launches nothing.
 *   - Pointers must be aligned to the element size. Outputs must not overlap
 *     each other or any input. With E > 0 every tensor pointer is required
 *     (alpha too, even when apply_alpha == 0); z_all may be NULL only when
 *     n_layers == 1. With E == 0 a call returns MIXSTACK_OK and touches
 *     nothing.
 *   - cu_stream is a CUstream of the stack's device (NULL: the legacy default
 *     stream). Work is enqueued on it and not waited for; scratch memory is
 *     allocated and freed stream-ordered on it.
 *   - The stack lives on the device's primary context (the one the CUDA
 *     runtime and PyTorch use). Calls restore the thread's current context.
 *   - A handle may be used from any thread, also concurrently; work on
 *     different streams is ordered only by the caller. Destroy a handle once,
 *     after its last call: a handle must not be destroyed while another
 *     thread is in a call on it.
 *   - Handles are checked: every function that takes one looks it up in a
 *     process-wide registry of live handles before using it, and refuses a
 *     destroyed handle, or any value no mixstack_stack_create* call returned (a
 *     foreign or garbage pointer), with MIXSTACK_ERR_INVALID_HANDLE without
 *     reading anything through it; mixstack_stack_destroy records the same
 *     error for mixstack_last_error() and frees nothing. A handle is an
 *     opaque token, not an address, and is never reused in a process, so a
 *     destroyed handle stays invalid after later creates. The registry guards
 *     against destroyed and foreign handles only; it does not make destroying
 *     a handle in use a supported pattern (if it happens anyway, the call in
 *     flight completes and the stack is freed when it returns, not by destroy;
 *     later calls with the handle are refused). The registry's lock is held
 *     only for the lookup, never while a call runs.
 */
#ifndef MIXSTACK_H
#define MIXSTACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this ABI; mixstack_abi_version() returns it. 2 added stacks that borrow
 * their weights (mixstack_stack_create_borrowing, mixstack_forward_w,
 * mixstack_backward_w) and mixstack_supports; 3 added the precision mode
 * (mixstack_set_precision, mixstack_last_precision); 4 made path 2 (FUSED) the measured
 * regime and added path 3 (FUSED_ALWAYS), the old meaning of 2. Earlier functions are
 * unchanged. */
#define MIXSTACK_ABI_VERSION 4

/* Status codes. */
typedef enum mixstack_status {
    MIXSTACK_OK = 0,
    MIXSTACK_ERR_NULL_POINTER = 1, /* a required pointer (handle, out-parameter, tensor with E > 0) is NULL */
    MIXSTACK_ERR_BAD_SHAPE = 2,    /* shape or E outside the build (negative, no kernel, size overflow) */
    MIXSTACK_ERR_BAD_DTYPE = 3,    /* unknown dtype code */
    MIXSTACK_ERR_MISALIGNED = 4,   /* tensor pointer not aligned to the element size */
    MIXSTACK_ERR_UNSUPPORTED = 5,  /* valid request the build or device cannot serve */
    MIXSTACK_ERR_CUDA = 6,         /* no CUDA driver, or a driver call failed */
    MIXSTACK_ERR_INTERNAL = 7,     /* a bug (caught panic, inconsistent kernel table) */
    MIXSTACK_ERR_BAD_ARGUMENT = 8, /* other invalid argument: path code, device, overlapping outputs,
                                      pointer not memory of the stack's device, stream of another
                                      context, malformed MIXSTACK_STACK_BWD_FUSED or
                                      MIXSTACK_PRECISION, weights outside the mode's range */
    MIXSTACK_ERR_INVALID_HANDLE = 9 /* a non-NULL handle that is not live: destroyed already, or not
                                       returned by a mixstack_stack_create* call (nothing is read through it) */
} mixstack_status;

/* dtype codes of mixstack_stack_create, mixstack_stack_create_borrowing, mixstack_supports. */
#define MIXSTACK_DTYPE_F32 0
#define MIXSTACK_DTYPE_F64 1

/* Backward path codes: AUTO reads MIXSTACK_STACK_BWD_FUSED at each call
 * (1/true/on/yes: FUSED; always: FUSED_ALWAYS; unset/0/false/off/no: relay).
 * FUSED runs the fused backward where it was measured faster than the relay on
 * this GPU (stages.yaml regime.fused_faster), FUSED_ALWAYS wherever its kernels
 * serve the shape (f32, Cf < 96); otherwise the relay runs (see
 * mixstack_last_path, which reports RELAY or FUSED). */
#define MIXSTACK_PATH_AUTO 0
#define MIXSTACK_PATH_RELAY 1
#define MIXSTACK_PATH_FUSED 2
#define MIXSTACK_PATH_FUSED_ALWAYS 3

/* Precision codes: the arithmetic of the block GEMMs (docs/PRECISION.md). AUTO reads
 * MIXSTACK_PRECISION at each call (exact or fp16x3; unset or empty: exact). FP16X3 runs
 * the GEMMs as three fp16 tensor-core products per step (f32 stacks, sm_90 builds);
 * the pointwise math stays exact. A mode the build cannot serve for the stack is
 * MIXSTACK_ERR_UNSUPPORTED, never another mode in its place. */
#define MIXSTACK_PRECISION_AUTO 0
#define MIXSTACK_PRECISION_EXACT 1
#define MIXSTACK_PRECISION_FP16X3 2

/* Opaque handle: one stack (shape, weights, kernels) on one device. A token checked
 * against the registry of live handles, never dereferenced by the caller or the library. */
typedef struct mixstack_stack mixstack_stack;

/* Create a stack of dtype (0 f32, 1 f64) on device `device` for shape (f, cf, lmax,
 * n_layers: 1 <= f <= 65535, n_layers <= 1024, cf and lmax as built); the weights are device pointers copied once (ordered on cu_stream); gw_dev
 * may be NULL when n_layers == 1. Stores the handle in *out (NULL on failure). */
int mixstack_stack_create(int dtype, int device, int64_t f, int64_t cf, int64_t lmax,
                          int64_t n_layers, const void* w0_dev, const void* w1_dev,
                          const void* gw_dev, void* cu_stream, mixstack_stack** out);

/* Forward over e edges (0 <= e <= 2^31 - 1): out = stack(u0) (times alpha when apply_alpha != 0), and the
 * gated layers' pre-activations into z_all. Enqueued on cu_stream. */
int mixstack_forward(mixstack_stack* stack, int64_t e, const void* u0, const void* alpha,
                     int apply_alpha, void* out, void* z_all, void* cu_stream);

/* Backward (input gradients only) over e edges from the forward's out and z_all: writes
 * grad_u0 and grad_alpha. path: 0 auto (MIXSTACK_STACK_BWD_FUSED), 1 relay, 2 fused where
 * measured faster, 3 fused wherever served (MIXSTACK_PATH_*). */
int mixstack_backward(mixstack_stack* stack, int64_t e, const void* grad_out, const void* out,
                      const void* z_all, const void* alpha, int apply_alpha, void* grad_u0,
                      void* grad_alpha, int path, void* cu_stream);

/* Whether the build serves a stack of dtype and shape (f, cf, lmax, n_layers): MIXSTACK_OK,
 * or MIXSTACK_ERR_BAD_SHAPE / MIXSTACK_ERR_BAD_DTYPE with the reason for
 * mixstack_last_error(). Reads the kernel table only: no driver, no device. */
int mixstack_supports(int dtype, int64_t f, int64_t cf, int64_t lmax, int64_t n_layers);

/* A stack that holds no weights (shape and kernels only): each call passes them, as a
 * model that assembles its weights from live parameters does. mixstack_forward and
 * mixstack_backward on it fail with MIXSTACK_ERR_BAD_ARGUMENT (with e == 0 they return
 * MIXSTACK_OK, as every call over no edge does); the _w calls below work
 * on any stack (on one that holds weights, the call's replace them for that call). */
int mixstack_stack_create_borrowing(int dtype, int device, int64_t f, int64_t cf, int64_t lmax,
                                    int64_t n_layers, mixstack_stack** out);

/* mixstack_forward with the call's weights: w0 (n_layers, F, M0, M0), w1 (n_layers, F,
 * M1, M1), gw (n_layers-1, F, Cf, LG; may be NULL when n_layers == 1), row-major (in,
 * out), device memory of the stack's device, read on cu_stream. Outputs must not
 * overlap them. */
int mixstack_forward_w(mixstack_stack* stack, int64_t e, const void* u0, const void* alpha,
                       int apply_alpha, const void* w0, const void* w1, const void* gw,
                       void* out, void* z_all, void* cu_stream);

/* mixstack_backward with the call's weights, as the backward reads them: wt0 and wt1
 * the per-block transposes of w0 and w1 (wt[k][f][o][i] = w[k][f][i][o]), gw as in
 * mixstack_forward_w and gwt its per-block transpose (n_layers-1, F, LG, Cf); gw and
 * gwt may be NULL when n_layers == 1. */
int mixstack_backward_w(mixstack_stack* stack, int64_t e, const void* grad_out, const void* out,
                        const void* z_all, const void* alpha, int apply_alpha, const void* wt0,
                        const void* wt1, const void* gw, const void* gwt, void* grad_u0,
                        void* grad_alpha, int path, void* cu_stream);

/* Path taken by the handle's last backward call: *path = 1 relay, 2 fused, 0 none yet;
 * the reason is copied NUL-terminated into reason (truncated to reason_len; may be NULL). */
int mixstack_last_path(const mixstack_stack* stack, int* path, char* reason, size_t reason_len);

/* The precision of the handle's calls from now on (default MIXSTACK_PRECISION_AUTO). */
int mixstack_set_precision(mixstack_stack* stack, int precision);

/* The mode the handle's last forward and last backward ran: *forward, *backward = 1 exact,
 * 2 fp16x3, 0 none yet. */
int mixstack_last_precision(const mixstack_stack* stack, int* forward, int* backward);

/* Every forward/backward call takes its scratch from the stack's own memory pool, which
 * keeps what a call freed mapped for the next call (as PyTorch's caching allocator does;
 * this memory is not PyTorch's). Hands that memory back to the device after waiting for
 * the device's work. */
int mixstack_release_cached_memory(mixstack_stack* stack);

/* Message of the last failing call on this thread ("" if none). Not a status; the pointer
 * stays valid until the next failing call on this thread. */
const char* mixstack_last_error(void);

/* Destroy a stack: waits for the device's work, frees the weights. NULL is a no-op.
 * Returns nothing. A handle that is not live (destroyed already, or not from
 * mixstack_stack_create) frees nothing and touches nothing: the call stores a message
 * naming mixstack_stack_destroy and MIXSTACK_ERR_INVALID_HANDLE for mixstack_last_error(). */
void mixstack_stack_destroy(mixstack_stack* stack);

/* MIXSTACK_ABI_VERSION of the loaded library (compare with the header's). */
int mixstack_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MIXSTACK_H */

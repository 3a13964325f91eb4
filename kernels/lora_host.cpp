// The CUDA LoRA op's host path in C++: the same passes as loragen/cuda/linear_op.py's eager Function
// (lora_down, the base product, lora_up; lora_grad_out, lora_grad_in, the base gradient), with ATen for
// allocations, sums and cuBLAS, and the four kernels launched through the driver's cuLaunchKernel.
//
// Built at run time by loragen/cuda/native_host.py against the installed torch's headers, and used only
// where LORAGEN_CUDA_NATIVE_HOST=1 asks for it. The ops are registered with the dispatcher
// (torch.ops.loragen_host); where Python's headers are installed the build also defines
// LORAGEN_PYTHON_ENTRY, and the per-call op gets a direct Python entry (python_lora_linear, at the end),
// which leaves out torch.ops' boxing of the arguments. What stays in Python, once per plan: choosing
// the kernel variant and its launcher (the self-check), the grids, loading the modules. What this file
// does per call is what the Python path does per call, without the interpreter: the factors' padded
// float32 copies (kept per parameter, refreshed when the parameter's version, storage or rank changes,
// after an optimizer step, inside a CUDA-graph capture, and after one), the output and partial-sum
// allocations, four launches, the sums.
//
// Driver entry points arrive as addresses (register_plan), so nothing here links against libcuda: on a
// GPU they are the driver's own; loragen's CPU tests pass a stand-in that runs emulated kernels on CPU
// tensors, and the host benchmark one that returns at once.
#ifdef LORAGEN_PYTHON_ENTRY
#include <Python.h>  // first, as Python's documentation asks
#endif
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/sum.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the driver ----------------------------------------------------------------------------------------

using LaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                             unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                             void* stream, void** params, void** extra);
using CtxGetCurrent = int (*)(void** context);
using CtxPushCurrent = int (*)(void* context);
using CtxPopCurrent = int (*)(void** context);
using StreamIsCapturing = int (*)(void* stream, int* status);
using GetErrorName = int (*)(int error, const char** name);

struct Driver {
    void* context = nullptr;  // the device's primary context, where the modules were loaded
    LaunchKernel launch = nullptr;
    CtxGetCurrent get_current = nullptr;
    CtxPushCurrent push_current = nullptr;
    CtxPopCurrent pop_current = nullptr;
    StreamIsCapturing is_capturing = nullptr;
    GetErrorName error_name = nullptr;
};

struct Kernel {
    const char* name = "";
    void* function = nullptr;
    unsigned threads = 0;
    unsigned grid_x = 0;
    unsigned grid_y = 0;
};

// What Python worked out once per (sizes, dtype, device, launcher): loragen.cuda.passes.Plan.
struct Plan {
    at::ScalarType dtype = at::kFloat;  // x's
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    int rows = 0;
    int in_features = 0;
    int out_features = 0;
    int rank = 0;
    int64_t bucket = 0;
    bool aligned = false;
    Kernel down, up, grad_out, grad_in;
    int64_t down_splits = 1;
    int cols_per_split = 0;
    int64_t grad_out_col_blocks = 1;
    int64_t grad_out_splits = 1;
    int grad_out_rows_per_split = 0;
    int64_t grad_in_splits = 1;
    int grad_in_rows_per_split = 0;
    Driver driver;
};

std::mutex plans_lock;
std::vector<std::unique_ptr<Plan>> plans;

const Plan& plan_at(int64_t id) {
    std::lock_guard<std::mutex> guard(plans_lock);
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(plans.size()), "loragen_host: no plan ", id);
    return *plans[id];
}

void* current_stream(const at::Tensor& t) {
    if (!t.is_cuda()) return nullptr;  // the CPU tests' stand-in driver runs on the host
    const auto* impl = c10::impl::getDeviceGuardImpl(t.device().type());
    return impl->getStream(t.device()).native_handle();
}

// Launch one kernel on torch's current stream, in the device's primary context (pushed, and popped after,
// only when another context or none is current on this thread, as autograd's device threads may have).
void launch(const Plan& plan, const Kernel& kernel, void* stream, void** params) {
    const Driver& d = plan.driver;
    void* current = nullptr;
    const bool switch_context = d.get_current(&current) != 0 || current != d.context;
    if (switch_context) {
        const int pushed = d.push_current(d.context);
        TORCH_CHECK(pushed == 0, "loragen.cuda: cuCtxPushCurrent failed (kernel ", kernel.name, "): error ",
                    pushed);
    }
    const int status = d.launch(kernel.function, kernel.grid_x, kernel.grid_y, 1, kernel.threads, 1, 1, 0,
                                stream, params, nullptr);
    if (switch_context) {
        void* popped = nullptr;
        d.pop_current(&popped);
    }
    if (status != 0) {
        const char* name = nullptr;
        if (d.error_name == nullptr || d.error_name(status, &name) != 0 || name == nullptr) name = "unknown";
        TORCH_CHECK(false, "loragen.cuda: cuLaunchKernel failed (kernel ", kernel.name, " grid=(",
                    kernel.grid_x, ", ", kernel.grid_y, ")): ", name, " (", status, ")");
    }
}

// Whether x's stream is being captured into a CUDA graph. The legacy default stream (handle 0) cannot be;
// a CPU tensor (the tests' stand-in driver) asks the driver with no stream.
bool capturing(const Plan& plan, const at::Tensor& x, void* stream) {
    if (plan.driver.is_capturing == nullptr || (stream == nullptr && x.is_cuda())) return false;
    int status = 0;
    return plan.driver.is_capturing(stream, &status) == 0 && status != 0;
}

// ---- the factors as the kernels read them --------------------------------------------------------------

// A (r, in) or B^T (r, out) as float32 (R, features), rows r..R-1 zero, one buffer per parameter; the
// parameter is held weakly, and entries of parameters that are gone are dropped as the table grows.
// Copied again when the parameter's version, storage or rank changes, after an optimizer step (`steps`:
// some optimizers write parameters without moving their version counters; loragen/cuda/hostcache.py
// reports every step through optimizer_stepped), inside a CUDA-graph capture, and on every call once a
// capture has read it (`captured`: a replay changes parameters in place, a captured optimizer step,
// without moving their version counters). Work queued inside a capture runs only when the graph replays,
// so the buffer is zeroed again by every call until one outside a capture has done it (`zeroed`). The
// buffer is made outside inference mode: one made under it could never be written again outside it.
std::atomic<uint64_t> optimizer_steps{0};

void optimizer_stepped() { optimizer_steps.fetch_add(1, std::memory_order_relaxed); }

struct Factor {
    Factor(const at::Tensor& t, at::Tensor storage)
        : source(t.getIntrusivePtr()), buffer(std::move(storage)) {}
    c10::weak_intrusive_ptr<c10::TensorImpl> source;
    at::Tensor buffer;
    uint32_t version = 0;
    const void* data = nullptr;
    uint64_t steps = 0;
    int64_t rank = -1;
    bool filled = false;
    bool captured = false;
    bool zeroed = false;
};

struct FactorKey {
    const c10::TensorImpl* impl;
    bool transposed;
    bool operator==(const FactorKey& other) const {
        return impl == other.impl && transposed == other.transposed;
    }
};

struct FactorKeyHash {
    size_t operator()(const FactorKey& key) const {
        return std::hash<const void*>()(key.impl) ^ static_cast<size_t>(key.transposed);
    }
};

std::mutex factors_lock;
std::unordered_map<FactorKey, Factor, FactorKeyHash> factors;
size_t sweep_at = 256;

void sweep_factors() {  // under factors_lock
    for (auto it = factors.begin(); it != factors.end();) {
        it = it->second.source.expired() ? factors.erase(it) : std::next(it);
    }
    sweep_at = std::max<size_t>(256, 2 * factors.size());
}

at::Tensor factor(const at::Tensor& t, const Plan& plan, bool transposed, bool refresh) {
    if (!transposed && t.scalar_type() == at::kFloat && t.size(0) == plan.bucket && t.is_contiguous() &&
        (!plan.aligned || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0)) {
        return t;  // already what the kernels read
    }
    const int64_t features = transposed ? t.size(0) : t.size(1);
    const uint32_t version = t.unsafeGetTensorImpl()->version_counter().current_version();
    std::lock_guard<std::mutex> guard(factors_lock);
    const FactorKey key{t.unsafeGetTensorImpl(), transposed};
    auto it = factors.find(key);
    if (it == factors.end() || it->second.source.lock().get() != t.unsafeGetTensorImpl() ||
        it->second.buffer.size(0) != plan.bucket || it->second.buffer.size(1) != features ||
        it->second.buffer.device() != t.device()) {
        if (factors.size() >= sweep_at) sweep_factors();
        c10::InferenceMode outside(false);
        Factor fresh(t, at::empty({plan.bucket, features}, t.options().dtype(at::kFloat)));
        it = factors.insert_or_assign(key, std::move(fresh)).first;
    }
    Factor& entry = it->second;
    const uint64_t steps = optimizer_steps.load(std::memory_order_relaxed);
    const int64_t rank = transposed ? t.size(1) : t.size(0);
    if (refresh || entry.captured || !entry.filled || entry.version != version ||
        entry.data != t.const_data_ptr() || entry.steps != steps || entry.rank != rank) {
        if (!entry.zeroed || rank < entry.rank) {  // a smaller rank leaves rows that must be zero
            entry.buffer.zero_();
            entry.zeroed = !refresh;
        }
        entry.buffer.narrow(0, 0, rank).copy_(transposed ? t.t() : t);
        entry.version = version;
        entry.data = t.const_data_ptr();
        entry.steps = steps;
        entry.rank = rank;
        entry.filled = true;
        entry.captured = entry.captured || refresh;
    }
    return entry.buffer;
}

// ---- inputs as the kernels read them -------------------------------------------------------------------

at::Tensor prepared(const at::Tensor& t, const Plan& plan) {
    at::Tensor out = t.contiguous();
    if (plan.aligned && reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 != 0) out = out.clone();
    return out;
}

void* pointer(const at::Tensor& t) { return t.defined() ? const_cast<void*>(t.const_data_ptr()) : nullptr; }

// A pass's float32 partial sums, (count, rows, cols), or (rows, cols) when there is one part: the kernels
// see the same layout either way, and the common single part needs no view and no sum.
at::Tensor parts_buffer(int64_t count, int64_t rows, int64_t cols, const at::TensorOptions& f32) {
    return count == 1 ? at::empty({rows, cols}, f32) : at::empty({count, rows, cols}, f32);
}

at::Tensor summed(const at::Tensor& parts, int64_t count) { return count == 1 ? parts : parts.sum(0); }

// The parameter lists the launches below fill in, in the kernels' order and C types: a test holds them
// equal to loragen/cuda/specs.py, which the kernel templates are rendered from.
const std::vector<std::string> signatures = {
    "lora_down(const scalar_t*,const float*,float*,int,int,int,int,const u64*,unsigned,float)",
    "lora_up(const float*,const float*,const scalar_t*,scalar_t*,int,int,int,float)",
    "lora_grad_out(const scalar_t*,const float*,const float*,float*,float*,int,int,int,int,float)",
    "lora_grad_in(const scalar_t*,const float*,const float*,scalar_t*,float*,int,int,int,int,const u64*,"
    "unsigned,float)",
};

// ---- the autograd node ---------------------------------------------------------------------------------

struct LoraLinear : public torch::autograd::Function<LoraLinear> {
    // inputs: x, weight, bias, lora_A, lora_B, rng, plan, scaling, threshold, keep_scale, fan_in_fan_out
    // (bias and rng optional: autograd gives absent ones no input edge)
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& maybe_bias, const at::Tensor& lora_a,
                              const at::Tensor& lora_b, const std::optional<at::Tensor>& maybe_rng,
                              int64_t plan_id, double scaling, int64_t threshold, double keep_scale,
                              bool fan_in_fan_out) {
        const Plan& plan = plan_at(plan_id);
        // x as the kernels read it, saved for backward: made above autograd's view handling, so that a view
        // of x shares x's version counter and an in-place change of x before backward is refused
        at::Tensor x2 = prepared(x.reshape({-1, x.size(-1)}), plan);
        // the rest below autograd's kernels: this node is the autograd record (grad mode is already off)
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        const at::Tensor bias = maybe_bias.value_or(at::Tensor());
        const at::Tensor rng = maybe_rng.value_or(at::Tensor());
        void* stream = current_stream(x);
        const bool refresh = capturing(plan, x, stream);
        at::Tensor a32 = factor(lora_a, plan, false, refresh);
        at::Tensor bt32 = factor(lora_b, plan, true, refresh);

        // h = dropout(x) A^T, float32 (rows, R), from column-split partials
        at::Tensor h_part = parts_buffer(plan.down_splits, plan.rows, plan.bucket, x.options().dtype(at::kFloat));
        {
            void* xp = pointer(x2);
            void* ap = pointer(a32);
            void* hp = pointer(h_part);
            int rows = plan.rows, cols = plan.in_features, rank = plan.rank, split = plan.cols_per_split;
            void* rngp = threshold != 0 ? pointer(rng) : nullptr;
            unsigned thr = static_cast<unsigned>(threshold);
            float keep = static_cast<float>(keep_scale);
            void* params[] = {&xp, &ap, &hp, &rows, &cols, &rank, &split, &rngp, &thr, &keep};
            launch(plan, plan.down, stream, params);
        }
        at::Tensor h = summed(h_part, plan.down_splits);

        // y = x W^T in x's dtype (cuBLAS), then lora_up adds bias + s h B^T in float32, rounding once
        std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
        out_shape.back() = plan.out_features;
        at::Tensor out = at::empty(out_shape, x.options());
        at::Tensor out2 = out.view({plan.rows, plan.out_features});
        at::mm_out(out2, x2, fan_in_fan_out ? weight : weight.t());
        at::Tensor bias_in;
        if (bias.defined()) bias_in = prepared(bias.scalar_type() == x.scalar_type() ? bias : bias.to(x.scalar_type()), plan);
        {
            void* hp = pointer(h);
            void* bp = pointer(bt32);
            void* biasp = pointer(bias_in);
            void* op = pointer(out2);
            int rows = plan.rows, cols = plan.out_features, rank = plan.rank;
            float s = static_cast<float>(scaling);
            void* params[] = {&hp, &bp, &biasp, &op, &rows, &cols, &rank, &s};
            launch(plan, plan.up, stream, params);
        }

        ctx->save_for_backward({x2, weight, lora_a, lora_b, h, rng});
        // a32 and bt32 cannot go stale: A and B are saved, so autograd refuses a backward after an
        // in-place change of either. One tuple: each saved_data entry is a string-keyed map insert.
        ctx->saved_data["args"] = c10::ivalue::Tuple::create(
            {plan_id, scaling, threshold, keep_scale, fan_in_fan_out, bias.defined(), a32, bt32, x.sizes().vec()});
        return out;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        // once differentiable: no graph of this backward is recorded, so backward(create_graph=True) is
        // refused here, rather than its results coming back without their second-order terms
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "loragen: the CUDA LoRA op on the C++ host path is differentiable once; a backward with "
                    "create_graph=True through it is not supported (turn LORAGEN_CUDA_NATIVE_HOST off: the "
                    "Python path refuses only the second backward itself)");
        // below autograd's kernels too; and without autocast, should backward run inside an autocast
        // region, as the forward ran
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const auto args = ctx->saved_data["args"].toTuple();
        const auto& arg = args->elements();
        const Plan& plan = plan_at(arg[0].toInt());
        const double scaling = arg[1].toDouble();
        const int64_t threshold = arg[2].toInt();
        const double keep_scale = arg[3].toDouble();
        const bool fan_in_fan_out = arg[4].toBool();
        const bool has_bias = arg[5].toBool();
        const auto saved = ctx->get_saved_variables();
        const at::Tensor& x2 = saved[0];
        const at::Tensor& weight = saved[1];
        const at::Tensor& lora_a = saved[2];
        const at::Tensor& lora_b = saved[3];
        const at::Tensor& h = saved[4];
        const at::Tensor& rng = saved[5];
        // needs_input_grad counts input edges: bias has one only when given
        const size_t factors_at = has_bias ? 3 : 2;
        const bool need_x = ctx->needs_input_grad(0);
        const bool need_w = ctx->needs_input_grad(1);
        const bool need_b = has_bias && ctx->needs_input_grad(2);
        const bool need_a = ctx->needs_input_grad(factors_at);
        const bool need_bb = ctx->needs_input_grad(factors_at + 1);
        variable_list result(11);
        if (!grads[0].defined()) return result;

        void* stream = current_stream(x2);
        at::Tensor g = grads[0].reshape({plan.rows, plan.out_features});
        at::Tensor g2 = prepared(g.scalar_type() == x2.scalar_type() ? g : g.to(x2.scalar_type()), plan);
        const auto f32 = x2.options().dtype(at::kFloat);
        if (need_x || need_a || need_bb) {  // grad_x always has a LoRA term, frozen adapter or not
            // dh = s g B (rows, R) and dB = s g^T h (out, R), float32, from partials
            at::Tensor dh_part = parts_buffer(plan.grad_out_col_blocks, plan.rows, plan.bucket, f32);
            at::Tensor db_part = parts_buffer(plan.grad_out_splits, plan.out_features, plan.bucket, f32);
            const at::Tensor& bt32 = arg[7].toTensor();
            {
                void* gp = pointer(g2);
                void* hp = pointer(h);
                void* bp = pointer(bt32);
                void* dhp = pointer(dh_part);
                void* dbp = pointer(db_part);
                int rows = plan.rows, cols = plan.out_features, rank = plan.rank;
                int per_split = plan.grad_out_rows_per_split;
                float s = static_cast<float>(scaling);
                void* params[] = {&gp, &hp, &bp, &dhp, &dbp, &rows, &cols, &rank, &per_split, &s};
                launch(plan, plan.grad_out, stream, params);
            }
            at::Tensor dh = summed(dh_part, plan.grad_out_col_blocks);
            if (need_bb) {  // columns past the rank only when the rank is not a bucket
                at::Tensor db = summed(db_part, plan.grad_out_splits);
                at::Tensor grad_bb = plan.rank == plan.bucket ? db : db.narrow(1, 0, plan.rank).contiguous();
                result[4] = grad_bb.scalar_type() == lora_b.scalar_type() ? grad_bb : grad_bb.to(lora_b.scalar_type());
            }
            if (need_x || need_a) {
                // the LoRA part of grad_x (rows, in) in x's dtype, dA (R, in) float32 from partials
                at::Tensor gx = need_x ? at::empty_like(x2) : at::Tensor();
                at::Tensor da_part = parts_buffer(plan.grad_in_splits, plan.bucket, plan.in_features, f32);
                const at::Tensor& a32 = arg[6].toTensor();
                {
                    void* xp = pointer(x2);
                    void* dhp = pointer(dh);
                    void* ap = pointer(a32);
                    void* gxp = pointer(gx);
                    void* dap = pointer(da_part);
                    int rows = plan.rows, cols = plan.in_features, rank = plan.rank;
                    int per_split = plan.grad_in_rows_per_split;
                    void* rngp = threshold != 0 ? pointer(rng) : nullptr;
                    unsigned thr = static_cast<unsigned>(threshold);
                    float keep = static_cast<float>(keep_scale);
                    void* params[] = {&xp, &dhp, &ap, &gxp, &dap, &rows, &cols, &rank, &per_split, &rngp, &thr, &keep};
                    launch(plan, plan.grad_in, stream, params);
                }
                if (need_a) {  // rows past the rank only when the rank is not a bucket
                    at::Tensor da = summed(da_part, plan.grad_in_splits);
                    at::Tensor grad_a = plan.rank == plan.bucket ? da : da.narrow(0, 0, plan.rank);
                    result[3] = grad_a.scalar_type() == lora_a.scalar_type() ? grad_a : grad_a.to(lora_a.scalar_type());
                }
                if (need_x) {  // the base term onto the LoRA term, beta = 1: no (rows, in) temporary
                    gx.addmm_(g2, fan_in_fan_out ? weight.t() : weight);
                    result[0] = gx.view(arg[8].toIntVector());
                }
            }
        }
        if (need_w) result[1] = fan_in_fan_out ? at::mm(x2.t(), g2) : at::mm(g2.t(), x2);
        if (need_b) result[2] = g2.sum(0);
        return result;
    }
};

bool lora_dtype(const at::Tensor& t) {
    const auto type = t.scalar_type();
    return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// Whether the inputs are what the plan was made and checked for (loragen/cuda/op_inputs.py's checks, in
// the terms the plan fixes): a ValueError otherwise, before anything runs, so that the caller can take the
// Python path, which words the error or runs the composition. ``cast``: x, weight and bias are about to be
// cast to the plan's dtype (autocast), so any floating dtype fits.
void check_fits(const Plan& plan, int64_t plan_id, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& lora_a, const at::Tensor& lora_b,
                bool fan_in_fan_out, bool cast) {
    const auto dtype = plan.dtype;
    const auto device = plan.device;
    const int64_t in = plan.in_features, out = plan.out_features, rank = plan.rank;
    const auto base_dtype = [&](const at::Tensor& t) {
        return cast ? at::isFloatingType(t.scalar_type()) : t.scalar_type() == dtype;
    };
    const bool fits =
        base_dtype(x) && x.device() == device && x.dim() >= 1 && x.size(-1) == in &&
        x.numel() == static_cast<int64_t>(plan.rows) * in && weight.dim() == 2 &&
        weight.size(0) == (fan_in_fan_out ? in : out) && weight.size(1) == (fan_in_fan_out ? out : in) &&
        base_dtype(weight) && weight.device() == device &&
        (!bias.has_value() ||
         (bias->dim() == 1 && bias->size(0) == out && base_dtype(*bias) && bias->device() == device)) &&
        lora_a.dim() == 2 && lora_a.size(0) == rank && lora_a.size(1) == in && lora_dtype(lora_a) &&
        lora_a.device() == device && lora_b.dim() == 2 && lora_b.size(0) == out && lora_b.size(1) == rank &&
        lora_dtype(lora_b) && lora_b.device() == device;
    TORCH_CHECK_VALUE(fits, "loragen_host: the inputs do not fit plan ", plan_id);
}

at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& lora_a, const at::Tensor& lora_b, const std::optional<at::Tensor>& rng,
               bool draw_rng, int64_t plan_id, double scaling, int64_t threshold, double keep_scale,
               bool fan_in_fan_out) {
    // the kernels read (seed, offset) through a pointer whenever dropout is on: refuse what would be read
    // out of bounds (loragen's own callers always pass one or ask for it to be drawn)
    TORCH_CHECK_VALUE(threshold == 0 || draw_rng ||
                          (rng.has_value() && rng->scalar_type() == at::kLong && rng->numel() >= 2 &&
                           rng->is_contiguous() && rng->device() == x.device()),
                      "loragen_host: dropout needs rng, an int64 (seed, offset) tensor on x's device, or draw_rng");
    if (draw_rng && threshold != 0) {
        // (seed, offset) from the device's generator, as loragen.cuda.op_inputs.draw_rng draws them
        const at::Tensor drawn = at::randint(0, INT64_MAX, {2}, x.options().dtype(at::kLong));
        return LoraLinear::apply(x, weight, bias, lora_a, lora_b, drawn, plan_id, scaling, threshold,
                                 keep_scale, fan_in_fan_out);
    }
    return LoraLinear::apply(x, weight, bias, lora_a, lora_b, rng, plan_id, scaling, threshold, keep_scale,
                             fan_in_fan_out);
}

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& lora_a, const at::Tensor& lora_b, const std::optional<at::Tensor>& rng,
                       bool draw_rng, int64_t plan_id, double scaling, int64_t threshold, double keep_scale,
                       bool fan_in_fan_out) {
    const Plan& plan = plan_at(plan_id);
    // autocast on x's device, for the devices that have it (as loragen.cuda.op_inputs.autocast_dtype)
    const auto device_type = x.device().type();
    const bool autocast = (device_type == at::kCUDA || device_type == at::kCPU) &&
                          at::autocast::is_autocast_enabled(device_type);
    if (!autocast) {
        check_fits(plan, plan_id, x, weight, bias, lora_a, lora_b, fan_in_fan_out, false);
        return run(x, weight, bias, lora_a, lora_b, rng, draw_rng, plan_id, scaling, threshold, keep_scale,
                   fan_in_fan_out);
    }
    // Under autocast for x's device, as the Python path: x, weight and bias in the autocast dtype (as
    // F.linear takes them; casts autograd records, no-ops where the dtype is already that), the factors as
    // they are, and autocast off inside the op, whose kernels run in the dtypes they are given
    TORCH_CHECK_VALUE(at::autocast::get_autocast_dtype(device_type) == plan.dtype,
                      "loragen_host: the autocast dtype is not the dtype of plan ", plan_id);
    check_fits(plan, plan_id, x, weight, bias, lora_a, lora_b, fan_in_fan_out, true);
    const at::ScalarType dtype = plan.dtype;
    const at::Tensor x_cast = x.to(dtype);
    const at::Tensor weight_cast = weight.to(dtype);
    const std::optional<at::Tensor> bias_cast =
        bias.has_value() ? std::optional<at::Tensor>(bias->to(dtype)) : std::nullopt;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return run(x_cast, weight_cast, bias_cast, lora_a, lora_b, rng, draw_rng, plan_id, scaling, threshold,
               keep_scale, fan_in_fan_out);
}

int checked_int(int64_t value, const char* what) {
    TORCH_CHECK(value >= 0 && value <= INT_MAX, "loragen_host: ", what, "=", value, " does not fit an int");
    return static_cast<int>(value);
}

unsigned checked_unsigned(int64_t value, const char* what) {
    TORCH_CHECK(value > 0 && value <= UINT_MAX, "loragen_host: ", what, "=", value, " is not a grid size");
    return static_cast<unsigned>(value);
}

// like: a tensor of x's dtype and device; sizes: rows, in, out, rank, bucket, aligned, down (grid x, grid y, splits, cols per split), up (grid x,
// grid y), grad_out (grid x, grid y, column blocks, splits, rows per split), grad_in (grid x, grid y,
// splits, rows per split); kernels: (function, threads) for down, up, grad_out, grad_in; driver: the
// context, cuLaunchKernel, cuCtxGetCurrent, cuCtxPushCurrent, cuCtxPopCurrent, cuStreamIsCapturing (0:
// none), cuGetErrorName (0: none).
int64_t register_plan(const at::Tensor& like, at::IntArrayRef sizes, at::IntArrayRef kernels,
                      at::IntArrayRef driver) {
    TORCH_CHECK(sizes.size() == 21 && kernels.size() == 8 && driver.size() == 7,
                "loragen_host.register_plan: expected 21 sizes, 8 kernel values and 7 driver values");
    auto plan = std::make_unique<Plan>();
    plan->dtype = like.scalar_type();
    plan->device = like.device();
    plan->rows = checked_int(sizes[0], "rows");
    plan->in_features = checked_int(sizes[1], "in_features");
    plan->out_features = checked_int(sizes[2], "out_features");
    plan->rank = checked_int(sizes[3], "rank");
    plan->bucket = checked_int(sizes[4], "rank_bucket");
    plan->aligned = sizes[5] != 0;
    const char* names[] = {"lora_down", "lora_up", "lora_grad_out", "lora_grad_in"};
    Kernel* slots[] = {&plan->down, &plan->up, &plan->grad_out, &plan->grad_in};
    const size_t grids[][2] = {{6, 7}, {10, 11}, {12, 13}, {17, 18}};
    for (int i = 0; i < 4; ++i) {
        slots[i]->name = names[i];
        slots[i]->grid_x = checked_unsigned(sizes[grids[i][0]], "grid_x");
        slots[i]->grid_y = checked_unsigned(sizes[grids[i][1]], "grid_y");
        TORCH_CHECK(kernels[2 * i] != 0, "loragen_host.register_plan: no function for ", names[i]);
        slots[i]->function = reinterpret_cast<void*>(kernels[2 * i]);
        slots[i]->threads = checked_unsigned(kernels[2 * i + 1], "threads");
    }
    plan->down_splits = sizes[8];
    plan->cols_per_split = checked_int(sizes[9], "cols_per_split");
    plan->grad_out_col_blocks = sizes[14];
    plan->grad_out_splits = sizes[15];
    plan->grad_out_rows_per_split = checked_int(sizes[16], "rows_per_split");
    plan->grad_in_splits = sizes[19];
    plan->grad_in_rows_per_split = checked_int(sizes[20], "rows_per_split");
    TORCH_CHECK(driver[1] != 0 && driver[2] != 0 && driver[3] != 0 && driver[4] != 0,
                "loragen_host.register_plan: cuLaunchKernel and the context calls are required");
    plan->driver.context = reinterpret_cast<void*>(driver[0]);
    plan->driver.launch = reinterpret_cast<LaunchKernel>(driver[1]);
    plan->driver.get_current = reinterpret_cast<CtxGetCurrent>(driver[2]);
    plan->driver.push_current = reinterpret_cast<CtxPushCurrent>(driver[3]);
    plan->driver.pop_current = reinterpret_cast<CtxPopCurrent>(driver[4]);
    plan->driver.is_capturing = reinterpret_cast<StreamIsCapturing>(driver[5]);
    plan->driver.error_name = reinterpret_cast<GetErrorName>(driver[6]);
    std::lock_guard<std::mutex> guard(plans_lock);
    plans.push_back(std::move(plan));
    return static_cast<int64_t>(plans.size()) - 1;
}

std::vector<std::string> kernel_signatures() { return signatures; }

int64_t cached_factors() {
    std::lock_guard<std::mutex> guard(factors_lock);
    return static_cast<int64_t>(factors.size());
}

}  // namespace

#ifdef LORAGEN_PYTHON_ENTRY
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

// The GIL released while the op runs, as torch.ops releases it: other Python threads go on meanwhile.
struct WithoutGil {
    PyThreadState* state = PyEval_SaveThread();
    WithoutGil() = default;
    WithoutGil(const WithoutGil&) = delete;
    WithoutGil& operator=(const WithoutGil&) = delete;
    ~WithoutGil() { PyEval_RestoreThread(state); }
};

// A tensor argument the entry takes as it is: a torch.Tensor or an nn.Parameter, exactly (a subclass may
// override __torch_function__, which only torch.ops' call honours); None where the argument is optional.
bool plain_tensor(PyObject* arg, bool optional) {
    return (optional && arg == Py_None) || THPVariable_CheckExact(arg);
}

std::optional<at::Tensor> optional_tensor(PyObject* arg) {
    if (arg == Py_None) return std::nullopt;
    return THPVariable_Unpack(arg);
}

// lora_linear(x, weight, bias, lora_A, lora_B, rng, draw_rng, plan, scaling, threshold, keep_scale,
// fan_in_fan_out), the registered op's arguments in its order, positional. NotImplemented, before anything
// runs, where torch.ops would do more than call the op (a tensor subclass, a TorchFunctionMode): the caller
// then calls torch.ops.loragen_host.lora_linear. Errors as torch.ops raises them (ValueError: the inputs do
// not fit the plan).
PyObject* python_lora_linear(PyObject* /*module*/, PyObject* const* args, Py_ssize_t count) {
    HANDLE_TH_ERRORS
    TORCH_CHECK_TYPE(count == 12, "loragen_host.lora_linear: expected 12 arguments, got ", count);
    if (at::impl::torch_function_mode_enabled() || !plain_tensor(args[0], false) ||
        !plain_tensor(args[1], false) || !plain_tensor(args[2], true) || !plain_tensor(args[3], false) ||
        !plain_tensor(args[4], false) || !plain_tensor(args[5], true)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    const int draw_rng = PyObject_IsTrue(args[6]);
    const long long plan_id = PyLong_AsLongLong(args[7]);
    const double scaling = PyFloat_AsDouble(args[8]);
    const long long threshold = PyLong_AsLongLong(args[9]);
    const double keep_scale = PyFloat_AsDouble(args[10]);
    const int fan_in_fan_out = PyObject_IsTrue(args[11]);
    if (PyErr_Occurred()) return nullptr;  // a scalar of the wrong type: TypeError
    const at::Tensor& x = THPVariable_Unpack(args[0]);
    const at::Tensor& weight = THPVariable_Unpack(args[1]);
    const std::optional<at::Tensor> bias = optional_tensor(args[2]);
    const at::Tensor& lora_a = THPVariable_Unpack(args[3]);
    const at::Tensor& lora_b = THPVariable_Unpack(args[4]);
    const std::optional<at::Tensor> rng = optional_tensor(args[5]);
    at::Tensor out;
    {
        WithoutGil released;
        RECORD_FUNCTION("loragen_host::lora_linear", std::vector<c10::IValue>({x, weight, lora_a, lora_b}));
        out = lora_linear(x, weight, bias, lora_a, lora_b, rng, draw_rng != 0, plan_id, scaling, threshold,
                          keep_scale, fan_in_fan_out != 0);
    }
    return THPVariable_Wrap(std::move(out));
    END_HANDLE_TH_ERRORS
}

PyMethodDef python_entry_method = {"lora_linear", reinterpret_cast<PyCFunction>(
                                                      reinterpret_cast<void (*)()>(python_lora_linear)),
                                   METH_FASTCALL, "loragen_host.lora_linear without torch.ops' boxing"};

}  // namespace

// The direct entry as a Python callable (a new reference); loragen/cuda/native_host.py takes it through
// ctypes with the GIL held.
extern "C" __attribute__((visibility("default"))) PyObject* loragen_host_python_entry() {
    return PyCFunction_New(&python_entry_method, nullptr);
}
#endif

TORCH_LIBRARY(loragen_host, m) {
    m.def("lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor lora_A, Tensor lora_B, Tensor? rng, "
          "bool draw_rng, int plan, float scaling, int threshold, float keep_scale, bool fan_in_fan_out) -> Tensor");
    m.def("register_plan(Tensor like, int[] sizes, int[] kernels, int[] driver) -> int", &register_plan);
    m.def("kernel_signatures() -> str[]", &kernel_signatures);
    m.def("cached_factors() -> int", &cached_factors);
    m.def("optimizer_stepped() -> ()", &optimizer_stepped);
}

TORCH_LIBRARY_IMPL(loragen_host, CompositeImplicitAutograd, m) { m.impl("lora_linear", &lora_linear); }

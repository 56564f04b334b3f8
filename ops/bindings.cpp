// Python bindings: argument checks with messages that name the bad argument,
// tensors -> Segments, hyper-parameter folding, and the GIL release.
// Not <torch/extension.h>: it brings the whole C++ frontend (torch::nn, optim, data), 417k lines that took 54 of
// the build's 63 s on a 2-core machine; pybind11 with torch's tensor casters and the Tensor class compile in 20 s.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <cmath>
#include <cstdio>
#include <string>
#include "adamw_ops.h"
#include "classic.h"

namespace fshard {
namespace {

using TList = std::vector<at::Tensor>;

std::string arg(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// Numbers in messages go in as strings. On the H100 image (torch 2.11, the extension built there by its own
// compiler; session 25) every failed check whose message streamed a number segfaulted, while those streaming only
// strings, devices and dtypes raised: the numbers went through std::ostream's numeric formatting in this .so
// (c10::str streams its arguments), std::to_string needs no stream or locale. Not yet confirmed on that image
// (its device time ran out); tests/test_ops.py::test_errors_name_the_argument is the check.
template <typename T>
std::string num(T x) { return std::to_string(x); }
std::string num(double x) {  // 17 significant digits (a round trip), not to_string's six fixed decimals
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

void check_state(const at::Tensor& t, const at::Tensor& p0, const char* name, size_t i) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "fshard.ops.adamw_: ", arg(name, i),
                   " must be float32 (fp32 master params and moments), got ", t.scalar_type(),
                   "; keep optimizer state in fp32 and pass low-precision copies as param_copies");
  TORCH_CHECK_VALUE(t.device() == p0.device(), "fshard.ops.adamw_: ", arg(name, i), " is on ",
                    t.device(), " but params[0] is on ", p0.device(),
                    "; all tensors of one call must live on one device");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fshard.ops.adamw_: ", arg(name, i),
                    " is not contiguous; pass .contiguous() storage or a 1-D slice of a flat shard");
}

void check_same_numel(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK_VALUE(t.numel() == p.numel(), "fshard.ops.adamw_: ", arg(name, i), " has ", num(t.numel()),
                    " elements but params[", num(i), "] has ", num(p.numel()), "; they must match one to one");
  TORCH_CHECK_VALUE(t.device() == p.device(), "fshard.ops.adamw_: ", arg(name, i), " is on ",
                    t.device(), " but params[", num(i), "] is on ", p.device(),
                    "; all tensors of one call must live on one device");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fshard.ops.adamw_: ", arg(name, i),
                    " is not contiguous; pass .contiguous() storage or a 1-D slice of a flat shard");
}

int grad_type(const at::Tensor& g, size_t i) {
  switch (g.scalar_type()) {
    case at::kFloat: return kGradF32;
    case at::kBFloat16: return kGradBF16;
    case at::kHalf: return kGradF16;
    default:
      TORCH_CHECK_TYPE(false, "fshard.ops.adamw_: ", arg("grads", i), " has dtype ", g.scalar_type(),
                       "; grads must be float32, bfloat16 or float16");
  }
  return 0;
}

int copy_type(const at::Tensor& c, size_t i) {
  if (c.scalar_type() == at::kBFloat16) return kCopyBF16;
  if (c.scalar_type() == at::kHalf) return kCopyF16;
  TORCH_CHECK_TYPE(false, "fshard.ops.adamw_: ", arg("param_copies", i), " has dtype ",
                   c.scalar_type(), "; param_copies must be bfloat16 or float16");
  return 0;
}

// "auto" -> the best kernel the CPU runs; a named one must be one the CPU runs. `op` names the caller in errors.
int parse_isa(const std::string& isa, const char* op = "adamw_") {
  const int best = best_cpu_isa();
  if (isa == "auto") return best;
  int level = -1;
  for (int l : {kIsaScalar, kIsaAvx2, kIsaAvx512})
    if (isa == isa_name(l)) level = l;
  TORCH_CHECK_VALUE(level >= 0, "fshard.ops.", op, ": unknown CPU kernel isa='", isa,
                    "'; use 'auto', 'avx512', 'avx2' or 'scalar'");
  TORCH_CHECK_VALUE(level <= best, "fshard.ops.", op, ": isa='", isa, "' asked for, but this CPU runs at most '",
                    isa_name(best), "'; ask for that, a lower one, or 'auto'");
  return level;
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (int l = kIsaScalar; l <= best_cpu_isa(); ++l) out.push_back(isa_name(l));
  return out;
}

AdamConsts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double wd,
                       double grad_scale, bool adam_w_mode) {
  TORCH_CHECK_VALUE(step >= 1, "fshard.ops.adamw_: step must be >= 1 (the step count after "
                    "incrementing, as torch's bias correction uses it), got ", num(step));
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
                    "fshard.ops.adamw_: betas must be in [0, 1), got (", num(beta1), ", ", num(beta2), ")");
  // As ATen's fused Adam: fold in double, cast to float once.
  const double bc1 = 1 - std::pow(beta1, double(step));
  const double bc2 = 1 - std::pow(beta2, double(step));
  AdamConsts c;
  c.grad_scale = float(grad_scale);
  c.wd_mul = float(1 - lr * wd);
  c.wd = float(wd);
  c.lerp_w = float(1 - beta1);
  c.beta2 = float(beta2);
  c.sq_coeff = float(1 - beta2);
  c.bc2_sqrt = float(std::sqrt(bc2));
  c.eps = float(eps);
  c.neg_step_size = float(-(lr / bc1));
  c.adamw = adam_w_mode;
  c.has_wd = wd != 0.0;
  return c;
}

// A run's elements [off, off + len) of a unit's flat tensor (``offsets``: no view made a run, fs.adamw), on the
// device of params[0] and contiguous.
void check_span(const at::Tensor& t, const at::Tensor& p0, int64_t off, int64_t len, const char* name, size_t i) {
  TORCH_CHECK_VALUE(off >= 0 && len >= 0 && off <= t.numel() - len, "fshard.ops.adamw_: ", arg(name, i), " has ",
                    num(t.numel()), " elements, too few for offsets[", num(i), "] = ", num(off), " and the ",
                    num(len), " elements of grads[", num(i), "]");
  TORCH_CHECK_VALUE(t.device() == p0.device(), "fshard.ops.adamw_: ", arg(name, i), " is on ", t.device(),
                    " but params[0] is on ", p0.device(), "; all tensors of one call must live on one device");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fshard.ops.adamw_: ", arg(name, i),
                    " is not contiguous; pass .contiguous() storage or a 1-D slice of a flat shard");
}

bool adamw(const TList& params, const TList& grads, const TList& exp_avgs, const TList& exp_avg_sqs,
           const TList& copies, int64_t step, double lr, double beta1, double beta2, double eps,
           double weight_decay, double grad_scale, bool adam_w_mode, bool check_finite,
           const std::string& isa, const std::vector<int64_t>& offsets) {
  const size_t n = params.size();
  const bool spans = !offsets.empty();  // params[i] etc. whole tensors, run i at offsets[i], grads[i].numel() long
  TORCH_CHECK_VALUE(!spans || offsets.size() == n, "fshard.ops.adamw_: offsets has ", num(offsets.size()),
                    " entries but params has ", num(n), "; pass one offset per param or None");
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                    "fshard.ops.adamw_: params, grads, exp_avgs and exp_avg_sqs must have the same "
                    "length, got ", num(n), ", ", num(grads.size()), ", ", num(exp_avgs.size()), ", ",
                    num(exp_avg_sqs.size()));
  TORCH_CHECK_VALUE(copies.empty() || copies.size() == n, "fshard.ops.adamw_: param_copies has ",
                    num(copies.size()), " tensors but params has ", num(n), "; pass one copy per param or None");
  const AdamConsts c = make_consts(step, lr, beta1, beta2, eps, weight_decay, grad_scale, adam_w_mode);
  const int level = parse_isa(isa);
  if (n == 0) return false;
  const at::Tensor& p0 = params[0];
  std::vector<Segment> segs;
  segs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    check_state(params[i], p0, "params", i);
    check_state(exp_avgs[i], p0, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p0, "exp_avg_sqs", i);
    const int64_t off = spans ? offsets[i] : 0, len = spans ? grads[i].numel() : params[i].numel();
    if (spans) {
      check_span(params[i], p0, off, len, "params", i);
      check_span(exp_avgs[i], p0, off, len, "exp_avgs", i);
      check_span(exp_avg_sqs[i], p0, off, len, "exp_avg_sqs", i);
      check_span(grads[i], p0, 0, len, "grads", i);
    } else {
      check_same_numel(exp_avgs[i], params[i], "exp_avgs", i);
      check_same_numel(exp_avg_sqs[i], params[i], "exp_avg_sqs", i);
      check_same_numel(grads[i], params[i], "grads", i);
    }
    Segment s{};
    s.gtype = grad_type(grads[i], i);
    s.ctype = kCopyNone;
    if (!copies.empty()) {
      if (spans) {
        check_span(copies[i], p0, off, len, "param_copies", i);
      } else {
        check_same_numel(copies[i], params[i], "param_copies", i);
      }
      s.ctype = copy_type(copies[i], i);
      s.copy = static_cast<char*>(copies[i].data_ptr()) + off * copies[i].element_size();
    }
    s.p = params[i].data_ptr<float>() + off;
    s.g = grads[i].data_ptr();
    s.m = exp_avgs[i].data_ptr<float>() + off;
    s.v = exp_avg_sqs[i].data_ptr<float>() + off;
    s.n = len;
    if (s.n > 0) segs.push_back(s);
  }
  bool found;
  if (p0.is_cpu()) {
    found = adamw_cpu(segs, c, check_finite, level);
  } else if (p0.is_cuda()) {
#ifdef FSHARD_WITH_CUDA
    found = adamw_cuda(segs, c, check_finite, p0.get_device());
#else
    TORCH_CHECK(false, "fshard.ops.adamw_: tensors are on ", p0.device(),
                " but fshard.ops was built without CUDA (no CUDA toolkit or device at build time)");
#endif
  } else {
    TORCH_CHECK(false, "fshard.ops.adamw_: unsupported device ", p0.device(), "; use CPU or CUDA");
  }
  if (!found) {  // (bump_version on the TensorImpl: what torch::autograd::impl::bump_version does, without its headers)
    for (size_t i = 0; i < n; ++i) {
      params[i].unsafeGetTensorImpl()->bump_version();
      exp_avgs[i].unsafeGetTensorImpl()->bump_version();
      exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
      if (!copies.empty()) copies[i].unsafeGetTensorImpl()->bump_version();
    }
  }
  return found;
}

// Sum of squares over CPU tensors, in double; the Python wrapper sends tensors on other devices to torch.
double sq_norm(const TList& tensors, const std::string& isa) {
  const int level = parse_isa(isa, "sq_norm");
  std::vector<SqSegment> segs;
  segs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    int xtype = kGradF32;
    switch (t.scalar_type()) {
      case at::kFloat: break;
      case at::kBFloat16: xtype = kGradBF16; break;
      case at::kHalf: xtype = kGradF16; break;
      default:
        TORCH_CHECK_TYPE(false, "fshard.ops.sq_norm: ", arg("tensors", i), " has dtype ", t.scalar_type(),
                         "; it takes float32, bfloat16 or float16 tensors");
    }
    TORCH_CHECK_VALUE(t.is_cpu(), "fshard.ops.sq_norm: ", arg("tensors", i), " is on ", t.device(),
                      "; the native kernel takes CPU tensors (fshard.ops.sq_norm sends others to torch)");
    TORCH_CHECK_VALUE(t.is_contiguous(), "fshard.ops.sq_norm: ", arg("tensors", i),
                      " is not contiguous; pass .contiguous() storage or a 1-D slice of a flat shard");
    if (t.numel() > 0) segs.push_back({t.data_ptr(), t.numel(), xtype});
  }
  return sq_norm_cpu(segs, level);
}

// norm_continue over each of xs (part k: elements [starts[k], starts[k] + xs[k].numel()) of a parameter of
// totals[k] elements), each carrying states[k] (a float32 [k, 8] CPU tensor) in place.
void norm_continue_(const TList& xs, const std::vector<int64_t>& starts, const std::vector<int64_t>& totals,
                    at::Tensor states) {
  TORCH_CHECK_VALUE(xs.size() == starts.size() && xs.size() == totals.size(),
                    "fshard.ops.norm_continue_: xs, starts and totals differ in length");
  TORCH_CHECK_VALUE(states.is_cpu() && states.scalar_type() == at::kFloat && states.is_contiguous() &&
                        states.dim() == 2 && states.size(0) == static_cast<int64_t>(xs.size()) && states.size(1) == 8,
                    "fshard.ops.norm_continue_: states must be a contiguous float32 CPU tensor of shape [len(xs), 8]");
  float* st = states.data_ptr<float>();
  for (size_t k = 0; k < xs.size(); ++k) {
    const at::Tensor& t = xs[k];
    TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "fshard.ops.norm_continue_: ",
                      arg("xs", k), " must be a contiguous float32 CPU tensor");
    TORCH_CHECK_VALUE(starts[k] >= 0 && starts[k] + t.numel() <= totals[k], "fshard.ops.norm_continue_: ",
                      arg("xs", k), " (", num(t.numel()), " elements from ", num(starts[k]), ") overruns its parameter of ",
                      num(totals[k]));
    norm_continue(t.numel() ? t.data_ptr<float>() : nullptr, starts[k], t.numel(), totals[k], st + 8 * k);
  }
}

// One run of fs.optim.adam / sgd / adagrad (classic.h): the constants come folded in double by the caller (as
// torch's Python code folds them) and are cast to float here, as ATen casts a Python scalar for a float tensor.
void classic_step(int64_t kind, const at::Tensor& p, const at::Tensor& g, const TList& rows, double wd,
                  bool maximize, double lerp_w, double beta2, double sq_coeff, double bc2_sqrt, double eps,
                  double neg_step, bool amsgrad, double momentum, double damp1, double neg_lr, bool nesterov,
                  bool first, const std::string& isa) {
  TORCH_CHECK_VALUE(kind >= kClassicAdam && kind <= kClassicAdagrad, "fshard.ops: unknown kernel kind ", num(kind));
  const size_t want = kind == kClassicAdam ? (amsgrad ? 3 : 2) : kind == kClassicAdagrad ? 1 : (momentum != 0 ? 1 : 0);
  TORCH_CHECK_VALUE(rows.size() == want, "fshard.ops: this update keeps ", num(want), " row(s), got ", num(rows.size()));
  const char* names[] = {"param", "grad", "rows[0]", "rows[1]", "rows[2]"};
  std::vector<const at::Tensor*> all = {&p, &g};
  for (const auto& r : rows) all.push_back(&r);
  for (size_t i = 0; i < all.size(); ++i) {
    const at::Tensor& t = *all[i];
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat && t.is_cpu() && t.is_contiguous(), "fshard.ops: ", names[i],
                     " must be a contiguous float32 CPU tensor (got ", t.scalar_type(), " on ", t.device(), ")");
    TORCH_CHECK_VALUE(t.numel() == p.numel(), "fshard.ops: ", names[i], " has ", num(t.numel()),
                      " elements but param has ", num(p.numel()));
  }
  ClassicConsts c{};
  c.kind = static_cast<int>(kind);
  c.wd = float(wd);
  c.has_wd = wd != 0.0;
  c.maximize = maximize;
  c.lerp_w = float(lerp_w);
  c.lerp_small = std::fabs(c.lerp_w) < 0.5f;
  c.beta2 = float(beta2);
  c.sq_coeff = float(sq_coeff);
  c.bc2_sqrt = float(bc2_sqrt);
  c.eps = float(eps);
  c.neg_step = float(neg_step);
  c.amsgrad = amsgrad;
  c.momentum = float(momentum);
  c.damp1 = float(damp1);
  c.neg_lr = float(neg_lr);
  c.has_momentum = momentum != 0.0;
  c.nesterov = nesterov;
  c.first = first;
  ClassicSeg s{};
  s.p = p.data_ptr<float>();
  s.g = g.data_ptr<float>();
  float* r[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < rows.size(); ++i) r[i] = rows[i].data_ptr<float>();
  s.r0 = r[0], s.r1 = r[1], s.r2 = r[2];
  s.n = p.numel();
  classic_cpu(c, s, parse_isa(isa, "classic"));
  p.unsafeGetTensorImpl()->bump_version();
  for (const auto& t : rows) t.unsafeGetTensorImpl()->bump_version();
}

bool built_with_cuda() {
#ifdef FSHARD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace fshard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fshard native AdamW and sum-of-squares kernels";
  m.def("adamw", &fshard::adamw, py::call_guard<py::gil_scoped_release>(),
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("param_copies"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("adam_w_mode"),
        py::arg("check_finite"), py::arg("isa"), py::arg("offsets") = std::vector<int64_t>());
  m.def("sq_norm", &fshard::sq_norm, py::call_guard<py::gil_scoped_release>(), py::arg("tensors"), py::arg("isa"),
        "sum of x*x over all elements, in float64; bit-identical for every CPU kernel and thread count");
  m.def("norm_continue_", &fshard::norm_continue_, py::call_guard<py::gil_scoped_release>(), py::arg("xs"),
        py::arg("starts"), py::arg("totals"), py::arg("states"),
        "continue torch's CPU fp32 2-norm over parts of parameters, in element order (ops/torch_norm.cpp)");
  m.def("classic_step", &fshard::classic_step, py::call_guard<py::gil_scoped_release>(),
        "one run of fs.optim.adam/sgd/adagrad with torch's single-tensor CPU arithmetic (ops/classic.h)");
  m.def("classic_sqrt_is_mkl", &fshard::classic_sqrt_is_mkl);
  m.def("cpu_isas", &fshard::cpu_isas, "every CPU kernel this CPU runs, lowest first");
  m.def("built_with_cuda", &fshard::built_with_cuda);
}

// What torch's CPU build lacks for autograd on a CUDA tensor, supplied while a simulation
// runs (native.py builds and loads this; the package's docstring says why):
//   - a device guard for CUDA: one device, one stream, events that are always complete;
//   - hooks that say CUDA is built and present, which the autograd engine asks before it
//     picks a CUDA tensor's stream (at::accelerator::getCurrentStream).
// `millstream_sim_cuda_enable(1)` installs both and `(0)` puts back what was there, so
// outside a simulation torch is exactly as it was.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <new>
#include <typeinfo>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool) const override {
    return Stream(Stream::DEFAULT, d);
  }
  Stream exchangeStream(Stream s) const override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};

struct Hooks final : at::CUDAHooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};

// Never destroyed: a process that exits inside a simulation still has it registered when
// torch's own statics go.
const Guard* const guard = new Guard();
const c10::impl::DeviceGuardImplInterface* saved_guard = nullptr;
bool enabled = false;

// torch made its hooks object once, before this library loaded: the simulation's hooks take
// its place in the same memory (both hold only a vtable pointer), and the stock ones return.
at::CUDAHooksInterface& hooks() {
  return const_cast<at::CUDAHooksInterface&>(at::detail::getCUDAHooks());
}

}  // namespace

extern "C" int millstream_sim_cuda_enable(int on) {
  static_assert(sizeof(Hooks) == sizeof(at::CUDAHooksInterface), "hooks hold only a vtable");
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)];
  at::CUDAHooksInterface& h = hooks();
  if (on && !enabled) {
    if (typeid(h) != typeid(at::CUDAHooksInterface)) return -1;  // a CUDA build: not ours
    saved_guard = slot.load();
    slot.store(guard);
    h.~CUDAHooksInterface();
    new (&h) Hooks();
    enabled = true;
  } else if (!on && enabled) {
    slot.store(saved_guard);
    h.~CUDAHooksInterface();
    new (&h) at::CUDAHooksInterface();
    enabled = false;
  }
  return enabled ? 1 : 0;
}

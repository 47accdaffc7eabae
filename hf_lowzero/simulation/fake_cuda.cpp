// A CUDA device for fake tensors on a CPU-only build of torch (hf_lowzero.simulation).
//
// FakeTensorMode builds "cuda" tensors on any build of torch, and their forward runs, but autograd
// asks the device's guard for the current stream of every input and the accelerator hooks whether
// a CUDA device exists; a CPU-only build has neither, so backward stops. This library registers
// torch's own test guard (c10's FakeGuardImpl: a current device and stream per thread, no
// events) for CUDA, and hooks that report 8 devices. Nothing ever runs on them: only fake tensors,
// which hold no data, are meant to live there. It must be loaded before torch is imported (the
// hooks are looked up once, at import), in a process of its own: hf_lowzero/simulation/launch.py.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}

namespace at {
struct FakeCUDAHooks final : public CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs /*unused*/) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*unused*/) const override { return true; }
  DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  DeviceIndex current_device() const override {
    return c10::impl::FakeGuardImpl<DeviceType::CUDA>::getDeviceIndex();
  }
  DeviceIndex getCurrentDevice() const override { return current_device(); }
  bool isPinnedPtr(const void* /*unused*/) const override { return false; }
};
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);
}  // namespace at

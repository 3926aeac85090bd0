"""What `single` and `ddp` tell `lmlab plan` about their memory layout (Parallel.memory_layout)."""

from lmlab.api.layout import MemoryLayout
from lmlab_parallel.ddp import DistributedDataParallel
from lmlab_parallel.single import SingleDevice


def test_single_holds_everything_on_one_device_and_communicates_nothing():
    layout = SingleDevice().memory_layout(None, None, "32-true")
    assert layout == MemoryLayout(devices=1)
    assert SingleDevice().memory_layout(None, 8, "bf16-mixed").devices == 1  # one device, whatever is asked


def test_ddp_replicates_the_state_and_all_reduces_gradients_kept_in_buckets():
    ddp = DistributedDataParallel(DistributedDataParallel.Options(devices=4, num_nodes=2))
    layout = ddp.memory_layout(None, None, "32-true")
    assert (layout.devices, layout.data_parallel) == (8, 8)
    assert (layout.params, layout.grads, layout.optimizer) == (1.0, 1.0, 1.0)
    assert layout.persistent_grads and layout.grad_buffers == 0  # gradients are views of the buckets
    ((collective),) = layout.collectives
    assert (collective.op, collective.of, collective.group, collective.per) == ("all-reduce", "gradients", 8, "step")
    assert ddp.memory_layout(None, 16, "32-true").devices == 16  # lmlab plan --devices


def test_ddp_without_bucket_views_holds_gradients_twice_and_one_process_sends_nothing():
    options = DistributedDataParallel.Options(devices=1, gradient_as_bucket_view=False)
    layout = DistributedDataParallel(options).memory_layout(None, None, "32-true")
    assert not layout.persistent_grads and layout.grad_buffers == 1.0
    assert layout.collectives == ()

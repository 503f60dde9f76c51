"""The applier's vocabulary: the steps, their outcomes and the one documented set of
reasons a step was skipped or failed (docs/reasons.md). Pure."""

from __future__ import annotations

import enum

__all__ = ["Step", "Outcome", "Reason"]


class Step(str, enum.Enum):
    AFFINITY = "affinity"
    IRQ = "irq"
    MEMORY = "memory"
    UVB = "uvb"


class Outcome(str, enum.Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"
    FAILED = "failed"
    PENDING = "pending"  # the memory step of a daemon bind: its pages move after the answer


class Reason(str, enum.Enum):
    """Why a step was skipped or failed. The one documented set (docs/reasons.md)."""

    # affinity / uvb
    PID_GONE = "pid_gone"
    PID_RECYCLED = "pid_recycled"
    NOT_PERMITTED = "not_permitted"
    MASK_NARROWED = "mask_narrowed"
    MASK_REFUSED = "mask_refused"
    NO_THREADS = "no_threads"
    NO_UVB_THREADS = "no_uvb_threads"
    NOT_APPLICABLE = "not_applicable"  # e.g. uvb on a non-950 host, irq on 950
    # irq
    IRQ_NOT_WRITABLE = "irq_not_writable"
    IRQ_UNCHANGEABLE = "irq_unchangeable"
    IRQ_BINDING_DISABLED = "irq_binding_disabled"
    UNPROVEN = "unproven"  # the binding is only its caller's claim: its NPU's IRQs stay put
    NO_PCI_ADDRESS = "no_pci_address"
    NO_MSI_IRQS = "no_msi_irqs"
    NO_SQ_IRQ = "no_sq_irq"
    NO_IRQ_CPUS = "no_irq_cpus"
    IRQBALANCE_ACTIVE = "irqbalance_active"
    IRQBALANCE_UNREACHABLE = "irqbalance_unreachable"  # irqbalance runs; telling it to ban/unban failed
    IRQ_WRITE_FAILED = "irq_write_failed"  # a write failed (not EPERM/EIO) or read back differently
    INTERRUPTS_UNREADABLE = "interrupts_unreadable"  # /proc/interrupts missing or malformed
    # memory
    SINGLE_NUMA_NODE = "single_numa_node"
    NO_NUMA_INFO = "no_numa_info"
    MOVE_UNSUPPORTED = "move_unsupported"  # no move_pages(2) on this kernel or machine
    MEMORY_UNREADABLE = "memory_unreadable"  # maps / numa_maps / pagemap of the worker not readable
    TARGET_NODE_FULL = "target_node_full"  # the pool's node ran out of free memory
    MOVE_FAILED = "move_failed"  # move_pages(2) refused pages for another reason
    MOVE_CANCELLED = "move_cancelled"  # the worker was released or replaced before its pages moved
    MOVE_TOO_LARGE = "move_too_large"  # more mappings or pages off the node than one move walks
    # written by daemons that ran migratepages; read back from their state files, never produced
    MIGRATEPAGES_MISSING = "migratepages_missing"
    MIGRATEPAGES_FAILED = "migratepages_failed"
    # isolation (the masks of the rest of the host; shown by status, not a step of the bind)
    NO_HOUSEKEEPING_CPUS = "no_housekeeping_cpus"  # the bound workers' CPUs leave no CPU for the rest of the host
    CHANGED_BY_OWNER = "changed_by_owner"  # a mask changed by someone else since isolation set it: left as it is
    MASK_UNCHANGEABLE = "mask_unchangeable"  # a kernel thread or workqueue whose mask the kernel refuses to change
    MASK_WRITE_FAILED = "mask_write_failed"  # a kernel thread's or workqueue's mask write failed or read back wrong
    TASK_PINNED_INSIDE = "task_pinned_inside"  # host: a task its owner pinned wholly inside the protected CPUs: left
    TOO_MANY_TASKS = "too_many_tasks"  # host: the record holds as many moved tasks as the state file may: no more
    # release
    NOTHING_TO_RESTORE = "nothing_to_restore"
    # any step
    OS_ERROR = "os_error"  # an OS error the step did not expect; the detail names it

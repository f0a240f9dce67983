/* Structures shared by the BPF programs (sampler.bpf.c) and user space (src/bpf/abi.rs, which
 * mirrors each one with #[repr(C)] and compile-time size/offset asserts). Change both together
 * and bump ES_ABI_VERSION. */
#ifndef ENGINESCOPE_SAMPLER_H
#define ENGINESCOPE_SAMPLER_H

#define ES_ABI_VERSION 9
#define ES_MAX_FRAMES 128
#define ES_MAX_TARGETS 256
#define ES_MAX_THREADS 16384
#define ES_MAX_KFRAMES 64      /* kernel return addresses per native-stack record */
#define ES_USTACK_MAX 16384    /* bytes of user stack copied from sp (power of two) */

/* Per-process facts pushed by user space: where to find things in this interpreter. All
 * offsets in bytes; absolute addresses are in the target's address space. */
struct es_target {
    __u64 gil_locked_addr;      /* &_gil_runtime_state.locked (int); 0 = unknown */
    __u64 gil_holder_addr;      /* &_gil_runtime_state.last_holder (PyThreadState *) */
    __u64 gc_collecting_addr;   /* &gcstate->collecting (int) of the main interpreter */
    __u64 code_type_addr;       /* &PyCode_Type, to reject non-code executables; 0 = no check */
    __u64 code_tag_mask;        /* low bits to clear from f_executable (3.14 _PyStackRef) */
    __u64 text_lo, text_hi;     /* interpreter core's executable mapping: IP inside = Python */
    __u32 frame_kind;           /* 0: PyFrameObject chain (3.10); 1: _PyInterpreterFrame */
    __u32 tstate_frame;         /* PyThreadState -> frame / cframe / current_frame */
    __s32 cframe_current_frame; /* _PyCFrame.current_frame, -1 when there is no cframe */
    __u32 frame_previous;
    __u32 frame_code;
    __u32 frame_instr;          /* f_lasti (int, 3.10) / prev_instr / instr_ptr (pointer) */
    __s32 frame_owner;          /* -1: no owner field; frames with owner >= 3 are shims */
    __u32 code_firstlineno;
    __u32 code_adaptive;        /* offsetof(PyCodeObject, co_code_adaptive), 3.11+ */
    __u32 flags;                /* ES_TARGET_* */
    __u32 code_name;            /* offsetof(PyCodeObject, co_name) */
    __s32 frame_is_entry;       /* 3.11: offsetof(_PyInterpreterFrame, is_entry); -1 = none */
    /* GIL waits: futex waits of target threads on an address inside the GIL's struct. */
    __u64 gil_addr;             /* _gil_runtime_state of the main interpreter; 0 = no GIL tracing */
    __u32 gil_cond_off;         /* offsetof(cond): [cond, switch_cond) = waiting to take the GIL */
    __u32 gil_switch_off;       /* offsetof(switch_cond): [switch_cond, size) = forced-switch wait */
    __u32 gil_size;             /* sizeof(struct _gil_runtime_state) */
    __u32 gc_stats_stride;      /* sizeof(struct gc_generation_stats) */
    __u64 gc_stats_addr;        /* &gcstate->generation_stats[0] (collections, collected); 0 = unknown */
    __u32 gil_mutex_off;        /* offsetof(mutex), a glibc pthread_mutex_t; 0 = unknown */
    __u32 gil_switch_mutex_off; /* offsetof(switch_mutex) */
    /* 3.15: gc_stats_addr is &gcstate->generation_stats, a pointer to struct gc_stats, which
     * holds one ring of cumulative records per generation (pycore_interp_structs.h): ring g
     * at gc_ring_off[g] has gc_ring_slots[g] records of gc_stats_stride bytes, then an int8
     * index of the newest; collections and collected at gc_ring_counts_off in a record.
     * 0 = an inline array of {collections, collected, ...} (3.10-3.14). */
    __u32 gc_stats_ring;
    __u32 gc_ring_counts_off;
    __u32 gc_ring_off[3];
    __u32 gc_ring_slots[3];
};

#define ES_TARGET_OFFCPU 1      /* trace sched_switch for this process */
#define ES_TARGET_GIL 2         /* trace futex waits on the GIL */
#define ES_TARGET_GC 4          /* a write watchpoint on gcstate->collecting is set */
#define ES_TARGET_KSTACK 8      /* a kernel stack with each sample and blocking switch-out */
#define ES_TARGET_USTACK 16     /* user registers + a window of the user stack, likewise */
#define ES_TARGET_GC_UPROBE 32  /* GC pauses from a uprobe + uretprobe on the collector */
#define ES_TARGET_PREEMPT_LAST 64 /* a preempted switch-out sends no stack: the thread's last known
                                 * one stands for it (the agent's aggregated recordings) */

/* The `control` map's one value: which parts are off (`enginescope cost`'s off arms). A
 * program whose part is off returns at its first instruction. */
#define ES_OFF_SAMPLE 1         /* on_sample */
#define ES_OFF_SWITCH 2         /* on_switch: off-CPU intervals and GIL waits */
#define ES_OFF_GC 4             /* a GC's start (on_gc_enter, on_gc_write); its end is always
                                   seen, so that a collection begun while on still closes */
#define ES_OFF_PROBE 8          /* on_probe_hit */
#define ES_OFF_STACKS 16        /* the stack walks in the scheduler's hooks (on_switch, on_waking):
                                   a switch-out carries the thread's last known stack, a GIL wait
                                   and a wake no stack of the holder or waker */

/* One thread: its PyThreadState, found by user space walking interp->threads. */
struct es_thread {
    __u64 tstate;
    __u32 tgid;
    __u32 ustack_window;         /* bytes of user stack to copy (ES_TARGET_USTACK), sized by
                                  * user space from what this thread's unwinds read; 0 = all
                                  * (ES_USTACK_MAX) */
};

/* One Python frame as the kernel saw it: raw facts, resolved by user space. */
struct es_frame {
    __u64 code;          /* code object address */
    __s32 instr_offset;  /* byte offset into the bytecode of the current instruction; with
                          * ES_FRAME_ENTRY or'ed in when the frame was entered from C (the
                          * outermost frame of one evaluation-loop call) */
    __u32 code_id;       /* co_firstlineno ^ (co_name >> 4): tells user space whether a cached
                          * code object at this address is still the same one */
};

/* Bit in es_frame.instr_offset: this frame is the first one an evaluation-loop call ran (a
 * C-stack shim frame follows it (3.12+), or is_entry is set (3.11)). Bytecode is < 1 GiB. */
#define ES_FRAME_ENTRY 0x40000000

enum es_event_kind {
    ES_EV_SAMPLE = 1,     /* cpu-clock sample of a target thread: ip = its runtime
                           * (task->se.sum_exec_runtime, ns) */
    ES_EV_SWITCH_OUT = 2, /* target thread switched out: time, state, Python stack; ip = its
                           * runtime (as for ES_EV_SAMPLE, brought up to date by the switch) */
    ES_EV_SWITCH_IN = 3,  /* target thread switched back in: ip = its runtime */
    ES_EV_GIL_WAIT_START = 4, /* futex wait on the GIL begins: ip = holder tstate, cpu = offset
                               * in the GIL struct, frames = the holder's Python stack */
    ES_EV_GIL_WAIT_END = 5,   /* that futex wait returned */
    ES_EV_GC_EDGE = 6,        /* gcstate->collecting written: ip = new value; struct es_gc_edge */
    ES_EV_PROBE_HIT = 7,      /* a probed function's code object's reference count was
                               * written (a frame of it pushed or popped): ip = the watched
                               * address; struct es_probe_hit */
    ES_EV_NATIVE_STACK = 8,   /* struct es_native: kernel stack, user registers and stack
                               * bytes; sent right before the SAMPLE / SWITCH_OUT record of the
                               * same thread with the same time_ns (targets with
                               * ES_TARGET_KSTACK / ES_TARGET_USTACK only) */
    ES_EV_WAKE = 9,           /* a thread of the target woke another of its threads from a futex
                               * wait that is not the GIL's (a lock released, a condition
                               * notified): tid = the woken thread, ip = the waker's tid,
                               * frames = the waker's Python stack */
};

#define ES_EV_SWITCH_WAIT 128 /* on GIL_WAIT_START: the wait is the forced-switch handshake */


#define ES_EV_GIL 1        /* thread held the GIL */
#define ES_EV_GC 2         /* collection running */
#define ES_EV_NATIVE 4     /* IP outside the interpreter core */
#define ES_EV_KERNEL 8     /* CPU in kernel mode */
#define ES_EV_PARTIAL 16   /* stack walk stopped on an error */
#define ES_EV_NO_TSTATE 32 /* thread not (yet) known to user space */
#define ES_EV_TRUNCATED 64 /* more than ES_MAX_FRAMES frames */
#define ES_EV_PREEMPTED 128 /* switch-out while still runnable */
#define ES_EV_SAME_STACK 8  /* on SWITCH_OUT (same bit as KERNEL, which only SAMPLE uses): no
                             * frames sent, the thread's stack is the one its last walked
                             * sample or switch-out carried (every frame's address and
                             * instruction unchanged) */

struct es_event_header {
    __u8 kind;
    __u8 flags;
    __u16 nframes;
    __u32 tgid;
    __u32 tid;
    __u32 cpu;
    __u64 time_ns; /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
    __u64 ip;
};

struct es_event {
    struct es_event_header h;
    struct es_frame frames[ES_MAX_FRAMES];
};

/* A write to gcstate->collecting (watchpoint method), or an entry to / return from the
 * collector function (uprobe method: h.ip 1 at entry, 0 at return), with the per-generation
 * statistics at that moment. */
struct es_gc_edge {
    struct es_event_header h;
    __u64 collections[3];
    __u64 collected[3];
    __s64 generation; /* the collector's generation argument (uprobe entry); -1 = none */
};

/* A hit of a hardware write watchpoint set by `record --probe` on a probed code object's
 * reference count (ob_refcnt), in the executing thread: every Python call of the code object
 * increments it when its frame is pushed and decrements it when the frame is popped. */
struct es_probe_hit {
    struct es_event_header h;
    __u64 frame;    /* the thread's current _PyInterpreterFrame (the caller's at a push and,
                     * 3.11.7+, at a pop; the callee frame is not yet / no longer published) */
    __u64 previous; /* frame->previous */
    __u64 code;     /* frame's code object (tag bits cleared) */
    __u64 value;    /* the 8 watched bytes after the write (the new ob_refcnt) */
};

/* Native context of one sample or switch-out. Sent with only as many ustack bytes as were
 * copied (size = offsetof(ustack) + ustack_len). */
struct es_native {
    struct es_event_header h; /* ip = user ip (0 = unknown) */
    __u64 sp, bp;             /* user stack and frame pointer registers */
    __u32 ustack_len;         /* bytes of the user stack copied from sp */
    __u16 nkernel;            /* kernel return addresses in kstack, innermost first */
    __u16 pad;
    __u64 kstack[ES_MAX_KFRAMES];
    __u8 ustack[ES_USTACK_MAX];
};

/* Counters (per-CPU array, summed by user space). Every failure path has one. */
enum es_counter {
    ES_C_SAMPLES = 0,        /* perf_event program runs in a target */
    ES_C_SWITCH_OUT,
    ES_C_SWITCH_IN,
    ES_C_NO_TSTATE,
    ES_C_READ_FRAME_ERR,     /* a frame read failed (stack partial) */
    ES_C_READ_TSTATE_ERR,
    ES_C_TRUNCATED,
    ES_C_RINGBUF_FULL,       /* event dropped: ring buffer full (lost samples) */
    ES_C_SKIPPED_SHIM,
    ES_C_SKIPPED_NONCODE,
    ES_C_GIL_READ_ERR,
    ES_C_GC_READ_ERR,
    ES_C_GIL_WAITS,          /* futex waits on the GIL seen */
    ES_C_GC_EDGES,           /* writes to gcstate->collecting seen */
    ES_C_GIL_WAIT_UNPAIRED,  /* futex exit without a matching enter (attached mid-wait) */
    ES_C_PROBE_HITS,         /* probe breakpoint hits in a target */
    ES_C_PROBE_NO_FRAME,     /* probe hit whose frame could not be read */
    ES_C_SWITCH_NATIVE,      /* switches of threads with no Python thread state: not recorded */
    ES_C_NATIVE_STACKS,      /* native-stack records sent */
    ES_C_USTACK_READ_ERR,    /* user stack window unreadable (no native frames beyond the leaf) */
    ES_C_KSTACK_ERR,         /* bpf_get_stack (kernel) failed */
    ES_C_GIL_MUTEX_OWNER,    /* GIL waits on a GIL mutex blamed on the mutex's owner */
    ES_C_GC_UPROBE_HITS,     /* collector entries and returns seen by the GC uprobes */
    ES_C_GC_RETURN_UNPAIRED, /* collector return without an entry (attached mid-collection) */
    ES_C_GC_NESTED,          /* collector entered while it runs on that thread (not a pause) */
    ES_C_SAME_STACK,         /* switch-outs sent without frames: the stack last walked */
    ES_C_WAKES,              /* wake-ups of a target thread by another of its threads (futex) */
    ES_C_CODE_READS,         /* code objects read by walks (not remembered from one lately) */
    ES_C_FRAME_COPIES,       /* copies of frames' bytes from user memory by walks (a window or a chunk) */
    ES_C_COUNT,
};

#endif

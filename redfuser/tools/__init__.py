"""Scripts built on the library (benchmark, GPU check, MetaSchedule comparison): not
imported by it, and the only place besides ``tvm_adapter`` that may import TVM."""

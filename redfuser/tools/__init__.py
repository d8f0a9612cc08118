"""Scripts built on the library (benchmark, GPU check, MetaSchedule comparison): not
imported by it, and the only place besides the ``redfuser.tvm`` package that may import TVM."""

#!/bin/sh
# PID 1 of make test-kernels' VMs (tests/kernels/run.sh), from this run's disk: the cached root's init
# (tests/kernels/root-init) mounted the disk (vdb) at /vmcache-kernels/run and runs this. The root (vda)
# is read-only; the disk holds an overlay's upper layer (vmcache installed from its .deb, the checks):
# the two are mounted as one root, the checks run in it, and the VM powers off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
mount -t sysfs sys /sys 2>/dev/null
T=/vmcache-kernels
mkdir -p $T/lower $T/root
if mount --bind / $T/lower \
   && mount -t overlay overlay -o lowerdir=$T/lower,upperdir=$T/run/upper,workdir=$T/run/work $T/root; then
  for d in proc sys dev; do mount --rbind /$d $T/root/$d; done
  mount -t tmpfs tmpfs $T/root/run
  mount -t tmpfs tmpfs $T/root/tmp
  # The checks' files on the run's ext4 itself, not on the overlay (whose files' page cache is the
  # lower file's: cachestat of an overlay file sees none of it).
  mkdir -p $T/run/scratch $T/root/var/tmp/vmk
  mount --bind $T/run/scratch $T/root/var/tmp/vmk
  chroot $T/root /usr/local/lib/vmcache-kernels/run-checks
  echo "vmk: checks exited with $?"
else
  echo "vmk: FAIL init: cannot mount the run's disk over the root"
fi
sync
echo o > /proc/sysrq-trigger
sleep 60

"""kvbench in lm-eval: ``--model kvbench`` runs any lm-eval task through kvbench's engine under any policy.

``model`` holds the lm-eval model (importing it registers ``kvbench`` with lm-eval), ``cli`` the
``kvbench-lm-eval`` command, ``settings`` the model arguments as kvbench settings, ``requests`` the conversion of
lm-eval's requests. lm-eval is an optional extra (``pip install 'kvbench[lm-eval]'``): nothing here imports it
until it is used.
"""

"""ResNet-50 for CIFAR-10 shapes packaged for the kit: `python -m alpa_job train --model resnet_example.model:build`."""

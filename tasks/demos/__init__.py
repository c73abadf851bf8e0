"""The CIFAR world of the pipeline and tensor-parallel demos: the data, a small convolutional net cut into
layers and made tensor-parallel, the trainers that step a torch optimizer, and their loop."""

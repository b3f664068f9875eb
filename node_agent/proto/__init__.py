"""Kubelet gRPC APIs: the .proto files gpuslice wrote from the wire reference, and their generated code.

* ``deviceplugin_v1beta1.proto`` (package ``v1beta1``): ``Registration`` (served by the kubelet)
  and ``DevicePlugin`` (served by each plugin).
* ``podresources_v1.proto`` (package ``v1``): ``PodResourcesLister`` (served by the kubelet).

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` files are generated and committed; regenerate
them with ``python -m node_agent.proto.generate`` (see README.md in this folder).
"""

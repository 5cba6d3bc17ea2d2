// Command training-operator runs Kubeflow's training operator (TFJob, PyTorchJob)
// as a local process against a test API server.
//
// It is the upstream cmd/training-operator.v1 main with three changes a loopback
// test cluster needs: the webhook server listens on 127.0.0.1 with a certificate
// the caller made (the upstream one rotates certificates through a Secret and a
// Service the cluster would route to), metrics and health probes are off, and
// there is no leader election. The controllers and the validating webhooks are
// the operator's own, registered exactly as upstream registers them.
package main

import (
	"flag"
	"os"

	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	schedulerpluginsv1alpha1 "sigs.k8s.io/scheduler-plugins/apis/scheduling/v1alpha1"
	"volcano.sh/apis/pkg/apis/scheduling/v1beta1"

	kubeflowv1 "github.com/kubeflow/training-operator/pkg/apis/kubeflow.org/v1"
	"github.com/kubeflow/training-operator/pkg/config"
	controllerv1 "github.com/kubeflow/training-operator/pkg/controller.v1"
	"github.com/kubeflow/training-operator/pkg/controller.v1/common"
	"github.com/kubeflow/training-operator/pkg/webhooks"
)

var (
	scheme   = runtime.NewScheme()
	setupLog = ctrl.Log.WithName("setup")
)

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(kubeflowv1.AddToScheme(scheme))
	utilruntime.Must(v1beta1.AddToScheme(scheme))
	utilruntime.Must(schedulerpluginsv1alpha1.AddToScheme(scheme))
}

func main() {
	var schemes controllerv1.EnabledSchemes
	var webhookPort int
	var certDir string
	flag.Var(&schemes, "enable-scheme", "a job kind to run, as --enable-scheme=tfjob --enable-scheme=pytorchjob (case insensitive)")
	flag.IntVar(&webhookPort, "webhook-port", 0, "loopback port of the validating webhook server (0: no webhooks)")
	flag.StringVar(&certDir, "webhook-cert-dir", "", "directory holding tls.crt and tls.key for the webhook server")
	// PyTorch's flags as upstream has them: a PyTorchJob's Workers get the init container
	// that waits for its Master (an image is required once a job has both).
	flag.StringVar(&config.Config.PyTorchInitContainerImage, "pytorch-init-container-image",
		config.PyTorchInitContainerImageDefault, "The image for pytorch init container")
	flag.StringVar(&config.Config.PyTorchInitContainerTemplateFile, "pytorch-init-container-template-file",
		config.PyTorchInitContainerTemplateFileDefault, "The template file for pytorch init container")
	flag.IntVar(&config.Config.PyTorchInitContainerMaxTries, "pytorch-init-container-max-tries",
		config.PyTorchInitContainerMaxTriesDefault, "The number of tries for the pytorch init container")
	opts := zap.Options{Development: true}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))

	options := ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		LeaderElection:         false,
	}
	if webhookPort != 0 {
		options.WebhookServer = webhook.NewServer(webhook.Options{
			Host: "127.0.0.1", Port: webhookPort, CertDir: certDir,
		})
	}
	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), options)
	if err != nil {
		setupLog.Error(err, "unable to create manager")
		os.Exit(1)
	}
	if schemes.Empty() {
		setupLog.Info("no --enable-scheme given")
		os.Exit(2)
	}
	for _, kind := range schemes {
		if err := controllerv1.SupportedSchemeReconciler[kind](mgr, common.GenNonGangSchedulerSetupFunc(), 1); err != nil {
			setupLog.Error(err, "unable to create controller", "scheme", kind)
			os.Exit(1)
		}
		if webhookPort != 0 {
			if err := webhooks.SupportedSchemeWebhook[kind](mgr); err != nil {
				setupLog.Error(err, "unable to register webhook", "scheme", kind)
				os.Exit(1)
			}
		}
	}
	setupLog.Info("starting manager")
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		setupLog.Error(err, "manager stopped")
		os.Exit(1)
	}
}
